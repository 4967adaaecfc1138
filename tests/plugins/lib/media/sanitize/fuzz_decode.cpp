// libFuzzer target for the media decode path (plugins/lib/media/decode.cpp): the
// input's first 8 bytes choose the request (sampling, frames, size, resize,
// crop, flip, padding), the rest is written to a file and decoded as a video
// and as an image. Any exception is a clean rejection; a crash, leak, hang or
// sanitizer report is a bug.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <string>
#include <unistd.h>

#include "lib/media/decode.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  static const std::string path = "/tmp/wick-fuzz-" + std::to_string(::getpid()) + ".bin";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data + 8, 1, size - 8, f);
  std::fclose(f);
  using namespace wick::media;
  Request r;
  r.max_frames = 1 + data[0] % 24;
  r.sampling = static_cast<Sampling>(data[1] % 3);
  r.stride = 1 + data[2] % 5;
  r.fps = (data[2] & 0x80) ? 7.5 : 0;
  r.height = 8 + data[3] % 64;
  r.width = (data[4] & 1) ? r.height : 8 + data[4] % 64;
  r.resize = static_cast<Resize>(data[5] % 3);
  r.crop = static_cast<Crop>(data[6] % 3);
  r.flip = data[7] & 1;
  r.pad = (data[7] & 2) ? Pad::Loop : Pad::Repeat;
  r.random_start = data[7] & 4;
  r.max_pixels = 4096 * 4096;
  r.time_limit = 5;
  std::mt19937_64 rng(size);
  try {
    (void)decode_video(path, r, rng);
  } catch (const std::exception&) {
  }
  try {
    (void)decode_image(path, r, rng);
  } catch (const std::exception&) {
  }
  return 0;
}
