// data `image_folder`: images from a folder per class or a manifest, decoded
// by FFmpeg; the implementation is plugins/lib/media/folder.*.

#include <wick/data.hpp>

#include "lib/media/folder.hpp"

namespace {

std::shared_ptr<wick::Object> create(const wick::Options& options) {
  return wick::media::make_folder(options, wick::media::Kind::Image);
}

}  // namespace

WICK_PLUGIN(wick::plugin<wick::Dataset>(
    "image_folder",
    "images (JPEG, PNG, WebP) from a folder per class or a manifest, resized and cropped while decoding",
    wick::media::folder_options(wick::media::Kind::Image), &create))
