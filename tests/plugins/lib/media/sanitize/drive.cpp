// Runs the media decode path over a clip set (make_clips) and broken files,
// every sampling, resize and crop mode, under AddressSanitizer and
// UndefinedBehaviorSanitizer (tests/plugins/lib/media/sanitize/run.sh builds it).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "lib/media/decode.hpp"
#include "media/make_clips.hpp"

namespace fs = std::filesystem;
using namespace wick::media;

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const fs::path dir = argv[1];
  wick::quiet_media_logs();
  wick::ClipSetOptions o;
  o.classes = 2;
  o.per_class = 1;
  o.seconds = 1;
  wick::make_clip_set((dir / "clips").string(), o);
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() != ".csv" && e.path().extension() != ".jsonl") files.push_back(e.path());
  int ok = 0, rejected = 0;
  for (const auto& f : files) {
    for (int mode = 0; mode < 3 * 3 * 3; ++mode) {
      Request r;
      r.max_frames = 5 + mode % 7;
      r.sampling = static_cast<Sampling>(mode % 3);
      r.resize = static_cast<Resize>((mode / 3) % 3);
      r.crop = static_cast<Crop>((mode / 9) % 3);
      r.stride = 2;
      r.pad = mode % 2 ? Pad::Loop : Pad::Repeat;
      r.flip = mode % 4 == 1;
      r.height = 40;
      r.width = mode % 5 == 0 ? 56 : 40;
      std::mt19937_64 rng(mode);
      try {
        auto fr = decode_video(f.string(), r, rng);
        if (fr.data.size() != 3ULL * fr.t * fr.h * fr.w) return 3;
        ++ok;
      } catch (const std::exception&) {
        ++rejected;
      }
      try {
        (void)decode_image(f.string(), r, rng);
      } catch (const std::exception&) {
      }
    }
  }
  std::printf("decoded %d, rejected %d (files %zu)\n", ok, rejected, files.size());
  return ok > 0 ? 0 : 1;
}
