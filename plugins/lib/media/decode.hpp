#pragma once
// Frame-limited video and image decoding through FFmpeg (libavformat,
// libavcodec, libswscale), with no LibTorch: the media data plugins wrap it.
//
// Video: the wanted frame times are chosen first (sampling), then each is
// reached by seeking to the keyframe before it when that skips decoding, and
// decoding forward only as far as the first frame past it. "The frame at time
// t" is the last frame whose presentation timestamp is <= t, so variable
// frame rates and headers that over-report the length give the right frames.
// Each frame is cropped in its source plane and scaled by swscale straight
// into the output size as planar RGB (uint8, C x H x W); rotation metadata
// (the display matrix) is honoured.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace wick::media {

enum class Sampling { Uniform, RandomSegment, Stride };
enum class Pad { Repeat, Loop };
enum class Resize { ShorterSide, Exact, Letterbox };
enum class Crop { Center, RandomResized, None };

/// With max_frames = 0, a clip longer than this many frames at the stride is
/// refused (its name and count in the message), not decoded.
constexpr int kMaxAllFrames = 4096;

struct Request {
  // video
  int max_frames = 16;  // 0: every frame at the stride (Stride only), at most kMaxAllFrames
  Sampling sampling = Sampling::Uniform;
  int stride = 1;      // Stride: every stride-th frame at `fps`
  double fps = 0;      // Stride: resample to this rate first (0: the clip's own)
  bool random_start = false;  // Stride: start at a random time (else at the clip's start)
  Pad pad = Pad::Repeat;
  // geometry (video and images)
  int height = 112, width = 112;  // the output size (shorter_side without crop: the shorter side)
  Resize resize = Resize::ShorterSide;
  Crop crop = Crop::Center;
  double scale_min = 0.08, scale_max = 1.0;  // RandomResized: area fraction
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // RandomResized: aspect ratio
  bool flip = false;   // mirror horizontally (the caller draws it at random)
  // limits
  int threads = 1;             // decoder threads per file
  double time_limit = 0;       // seconds per file (0: none)
  std::int64_t max_pixels = 8192LL * 8192LL;  // refuse larger frames before decoding
};

struct Frames {
  int t = 0, h = 0, w = 0;
  std::vector<std::uint8_t> data;  // t x 3 x h x w, RGB
  std::vector<double> times;       // presentation time of each frame returned, seconds
  double duration = 0;             // of the clip, seconds (as far as known)
  int rotation = 0;                // degrees clockwise applied for display
  int frames_decoded = 0;          // how many frames the decoder produced: the cost
  int seeks = 0;
};

/// Decodes max_frames frames of a video file. Throws std::runtime_error naming
/// the file and what went wrong (not a video, no video stream, too large,
/// nothing decodable, time limit).
Frames decode_video(const std::string& path, const Request& req, std::mt19937_64& rng);

/// Decodes a still image (JPEG, PNG, WebP, or the first frame of anything
/// FFmpeg reads), t = 1.
Frames decode_image(const std::string& path, const Request& req, std::mt19937_64& rng);

/// The frame times `sampling` picks in a clip [start, start + duration) with
/// `frame_rate` frames per second (for Stride and short clips), max_frames of
/// them; with max_frames = 0 (Stride only), every stride-th frame at `fps`
/// from the start (or a random_start within the first stride) to the end.
/// Exposed for tests.
std::vector<double> sample_times(const Request& req, double start, double duration, double frame_rate,
                                 std::mt19937_64& rng);

}  // namespace wick::media
