// data `video_folder`: clips from a folder per class or a manifest, max_frames
// sampled frames each, resized while decoding (plugins/lib/media).

#include "lib/media/media_folder.hpp"

namespace {

class VideoFolder final : public wick_plugins::media_folder::MediaFolder {
 public:
  explicit VideoFolder(const wick::Options& o) : MediaFolder(o, /*video=*/true) {}
};

}  // namespace

WICK_PLUGIN(wick::plugin<VideoFolder>(
    "video_folder", "clips from a folder per class or a manifest: max_frames sampled frames, resized while decoding (FFmpeg)",
    wick_plugins::media_folder::schema(/*video=*/true)))
