// The data set behind `video_folder` and `image_folder`: clips or images from
// a folder per class or a manifest, decoded by FFmpeg (decode.hpp).
#pragma once

#include <wick/data.hpp>
#include <wick/options.hpp>

#include <memory>

namespace wick::media {

/// What a sample holds.
enum class Kind {
  Video,  ///< `video`: T x C x H x W uint8 frames (video_folder)
  Image,  ///< `image`: C x H x W uint8 (image_folder)
};

/// The data set, from options validated against folder_options(kind).
std::shared_ptr<wick::Dataset> make_folder(const wick::Options& options, Kind kind);

/// The options of video_folder (Kind::Video) or image_folder (Kind::Image).
wick::OptionSchema folder_options(Kind kind);

}  // namespace wick::media
