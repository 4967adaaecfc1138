#pragma once
// TensorBoard event files: TFRecord framing (length, masked CRC-32C of the
// length, the serialized Event, masked CRC-32C of it) around Event protocol
// buffers (tensorboard.proto, written with the protobuf library).

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace wick {

namespace tb {
class Event;  // tensorboard.proto
}

/// CRC-32C (Castagnoli), and the masked form TFRecord stores:
/// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t crc32c(std::string_view data);
std::uint32_t masked_crc32c(std::string_view data);

/// Writes one event file `events.out.tfevents.<seconds>.<host>.<pid>.<n>` in
/// a folder. Scalars are Summary.Value.simple_value (float32), as
/// torch.utils.tensorboard writes them and TensorBoard's readers take them
/// (the event accumulator's Scalars, the data server's scalars plugin;
/// metrics.jsonl keeps the doubles); text goes to the text plugin.
/// Every call writes whole records and flushes them (scalars: unless told
/// not to, when the caller flushes a group): a reader (or a crash) sees
/// complete steps.
class EventWriter {
 public:
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time,
               bool flush_now = true);
  void text(std::int64_t step, const std::string& tag, const std::string& text, double wall_time);
  /// A session START at `step`: TensorBoard's readers drop the events of
  /// earlier files at `step` and after (a resumed run's repeated steps).
  void session_start(std::int64_t step, double wall_time);
  void close();
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<tb::Event> last_scalars_;  // the last scalars message, reused while the tags stay the same
  std::vector<std::string> last_tags_;
};

/// Seconds since the epoch, as TensorBoard's wall_time.
double wall_time_now();

}  // namespace wick
