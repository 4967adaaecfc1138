// data `image_folder`: images from a folder per class or a manifest, resized
// and cropped while decoding (plugins/lib/media).

#include "lib/media/media_folder.hpp"

namespace {

class ImageFolder final : public wick_plugins::media_folder::MediaFolder {
 public:
  explicit ImageFolder(const wick::Options& o) : MediaFolder(o, /*video=*/false) {}
};

}  // namespace

WICK_PLUGIN(wick::plugin<ImageFolder>(
    "image_folder", "images (JPEG, PNG, WebP) from a folder per class or a manifest, resized and cropped while decoding",
    wick_plugins::media_folder::schema(/*video=*/false)))
