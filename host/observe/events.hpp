#pragma once
// TensorBoard event files: TFRecord framing (length, masked CRC-32C of the
// length, the serialized Event, masked CRC-32C of it) around Event protocol
// buffers (tensorboard.proto, written with the protobuf library).

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace wick {

/// CRC-32C (Castagnoli), and the masked form TFRecord stores:
/// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t crc32c(std::string_view data);
std::uint32_t masked_crc32c(std::string_view data);

/// Writes one event file `events.out.tfevents.<seconds>.<host>.<pid>.<n>` in
/// a folder. Scalars are float32 scalar tensors under TensorBoard's scalars
/// plugin (the only dtype TensorBoard's data server shows; metrics.jsonl keeps
/// the doubles); text goes to the text plugin.
/// Every call writes whole records and flushes them: a reader (or a crash)
/// sees complete steps.
class EventWriter {
 public:
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time);
  void text(std::int64_t step, const std::string& tag, const std::string& text, double wall_time);
  void close();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  void flush();
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// Seconds since the epoch, as TensorBoard's wall_time.
double wall_time_now();

}  // namespace wick
