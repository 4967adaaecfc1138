#include "observe/events.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "host/observe/tensorboard.pb.h"
#include "wick/kit/crc32c.hpp"

namespace wick {
namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace

std::uint32_t crc32c(std::string_view data) { return crc32c(data.data(), data.size()); }

std::uint32_t masked_crc32c(std::string_view data) {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventWriter::EventWriter(const std::string& dir) {
  static std::atomic<int> serial{0};
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const auto secs = static_cast<long long>(wall_time_now());
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(secs) + "." + host_name() + "." +
                                         std::to_string(::getpid()) + "." + std::to_string(serial++)))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw std::runtime_error("cannot write the TensorBoard event file " + path_ + ": " + std::strerror(errno));
  tb::Event e;
  e.set_wall_time(wall_time_now());
  e.set_file_version("brain.Event:2");
  write_record(e.SerializeAsString());
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::close() {
  if (file_ && std::fclose(file_) != 0) {
    file_ = nullptr;
    throw std::runtime_error("writing " + path_ + " failed: " + std::strerror(errno));
  }
  file_ = nullptr;
}

void EventWriter::write_record(const std::string& bytes) {
  if (!file_) throw std::runtime_error("the TensorBoard event file " + path_ + " is closed");
  char head[12];
  const std::uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((n >> (8 * i)) & 0xff);  // little-endian
  const std::uint32_t hc = masked_crc32c(std::string_view(head, 8));
  for (int i = 0; i < 4; ++i) head[8 + i] = static_cast<char>((hc >> (8 * i)) & 0xff);
  char tail[4];
  const std::uint32_t dc = masked_crc32c(bytes);
  for (int i = 0; i < 4; ++i) tail[i] = static_cast<char>((dc >> (8 * i)) & 0xff);
  if (std::fwrite(head, 1, 12, file_) != 12 || std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size() ||
      std::fwrite(tail, 1, 4, file_) != 4)
    throw std::runtime_error("writing " + path_ + " failed: " + std::strerror(errno));
}

void EventWriter::flush() {
  if (std::fflush(file_) != 0) throw std::runtime_error("writing " + path_ + " failed: " + std::strerror(errno));
}

void EventWriter::scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values,
                          double wall_time, bool flush_now) {
  if (values.empty()) return;
  // Steps log the same tags over and over: the message of the last call is
  // kept and only its numbers change (building it anew costs more than the
  // step of a small model).
  bool same = last_scalars_ && last_tags_.size() == values.size();
  for (std::size_t i = 0; same && i < values.size(); ++i) same = last_tags_[i] == values[i].first;
  if (!same) {
    last_scalars_ = std::make_unique<tb::Event>();
    last_tags_.clear();
    auto* summary = last_scalars_->mutable_summary();
    for (const auto& [tag, v] : values) {
      last_tags_.push_back(tag);
      // Summary.Value.simple_value, as torch.utils.tensorboard's add_scalar
      // writes it: what every reader of scalars reads (the event
      // accumulator's Scalars, the data server behind the UI)
      auto* val = summary->add_value();
      val->set_tag(tag);
      val->set_simple_value(0);
    }
  }
  tb::Event& e = *last_scalars_;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* summary = e.mutable_summary();
  for (std::size_t i = 0; i < values.size(); ++i)
    summary->mutable_value(static_cast<int>(i))->set_simple_value(static_cast<float>(values[i].second));
  write_record(e.SerializeAsString());
  if (flush_now) flush();
}

void EventWriter::session_start(std::int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  e.mutable_session_log()->set_status(tb::SessionLog::START);
  write_record(e.SerializeAsString());
}

void EventWriter::text(std::int64_t step, const std::string& tag, const std::string& text, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* val = e.mutable_summary()->add_value();
  val->set_tag(tag);
  auto* md = val->mutable_metadata();
  md->mutable_plugin_data()->set_plugin_name("text");
  md->set_data_class(tb::DATA_CLASS_TENSOR);
  auto* t = val->mutable_tensor();
  t->set_dtype(tb::DT_STRING);
  t->mutable_tensor_shape();
  t->add_string_val(text);
  write_record(e.SerializeAsString());
  flush();
}

}  // namespace wick
