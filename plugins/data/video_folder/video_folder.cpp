// data `video_folder`: clips from a folder per class or a manifest, sampled
// frames decoded by FFmpeg; the implementation is plugins/lib/media/folder.*.

#include <wick/data.hpp>

#include "lib/media/folder.hpp"

namespace {

std::shared_ptr<wick::Object> create(const wick::Options& options) {
  return wick::media::make_folder(options, wick::media::Kind::Video);
}

}  // namespace

WICK_PLUGIN(wick::plugin<wick::Dataset>(
    "video_folder",
    "clips from a folder per class or a manifest: max_frames sampled frames, resized while decoding (FFmpeg)",
    wick::media::folder_options(wick::media::Kind::Video), &create))
