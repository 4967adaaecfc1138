#pragma once
// A toy video and image data set, written with FFmpeg's libraries: a coloured
// shape (the class) moving over a plain background. Backs `wick make-clips`
// and makes the clips the video tests decode. No LibTorch here.
//
// Every video frame carries its index as a bar code along the top edge:
// 8 blocks side by side, block i covering x in [i*bw, (i+1)*bw) and y in
// [0, bh) with bw = width / 8 and bh = max(6, height / 10); block 0 (the
// leftmost) is the most significant bit of (frame index mod 256), white for 1
// and black for 0. frame_code_geometry() gives the numbers; read the code by
// sampling each block's centre (luma > 128 is a 1). The shape never enters the
// bar code's rows.

#include <cstdint>
#include <string>
#include <vector>

namespace wick {

struct ClipSetOptions {
  int classes = 3;    // shape classes, in order: circle, square, triangle, cross, ring, diamond (max 6)
  int per_class = 8;  // clips per class
  int width = 160, height = 120;
  double seconds = 2.0;  // length of each ordinary clip
  int fps = 25;
  std::uint64_t seed = 0;
  bool extras = true;  // also write the special test clips under DIR/extras
  bool images = true;  // also write still images per class under DIR/images
};

struct ClipSetReport {
  std::vector<std::string> files;  // every file written, manifests included
  int clips = 0;                   // ordinary clips (the ones in DIR/manifest.csv)
  int images = 0;                  // still images (the ones in DIR/images/manifest.csv)
  int extras = 0;                  // clips under DIR/extras
};

/// Writes the data set under dir (created if missing):
///   dir/videos/<class>/<class>_<k>.mp4           h264 in mp4, k = 0..per_class-1
///   dir/manifest.csv, dir/manifest.jsonl         path,label,text (path relative to dir)
///   dir/images/<class>/<class>_<k>.{png,jpg,webp} max(1, per_class/2) per class
///   dir/images/manifest.csv, .jsonl               path relative to dir/images
///   dir/extras/{mpeg4.avi, mjpeg.mkv, vp9.webm, vfr.mp4, rotated.mp4,
///               bframes.mp4, short.mp4, long.mp4}  (vp9.webm only when libvpx-vp9 exists)
/// Deterministic: the same options write the same bytes. Throws
/// std::invalid_argument for bad options and std::runtime_error naming the file
/// on any failure to write.
ClipSetReport make_clip_set(const std::string& dir, const ClipSetOptions& o);

/// One clip, for tests that need a specific one.
struct ClipSpec {
  std::string path;             // the container follows the extension: .mp4 .mkv .webm .avi .mov
  std::string codec = "h264";   // h264 (libx264), mpeg4, mjpeg, vp9 (libvpx-vp9)
  int width = 160, height = 120;  // at least 64x48, even
  int frames = 50;
  int fps = 25;
  int shape = 0;  // class index, 0..5
  std::uint64_t seed = 0;
  // Frame presentation times in a 1/100 time base with durations cycling
  // 1,3,1,2 ticks (fps is then ignored for timing).
  bool variable_frame_rate = false;
  // Display-matrix side data on the stream, written with
  // av_display_rotation_set(m, rotation): the degrees a player turns a decoded
  // frame clockwise for display (what a phone writes for a portrait clip, the
  // old "rotate" tag). av_display_rotation_get, and so ffprobe's "rotation",
  // read it back as -rotation (90 reads back as -90, 270 as 90); ffmpeg's
  // autorotation shows a 90 clip as height x width with the bar code on the
  // right edge. 0 writes no side data.
  int rotation = 0;
  int gop = 12;          // keyframe interval
  int max_b_frames = 0;  // h264 and mpeg4: B-frames between references (pts != dts when > 0)
};

void write_clip(const ClipSpec& s);

/// A still of shape `shape` (no bar code), encoded by the extension: .png, .jpg/.jpeg, .webp.
void write_image(const std::string& path, int width, int height, int shape, std::uint64_t seed);

/// The shape class names, index = label.
const std::vector<std::string>& clip_class_names();

/// Where the frame-index bar code sits in a width x height frame.
struct FrameCodeGeometry {
  int block_width, block_height;  // block i covers x in [i*block_width, (i+1)*block_width), y in [0, block_height)
  static constexpr int blocks = 8;
};
FrameCodeGeometry frame_code_geometry(int width, int height);

/// Reads the frame code back from an 8-bit luma (or any single-channel) plane
/// of a frame decoded from a width x height clip and possibly resized to
/// plane_width x plane_height: samples each block's centre, scaled.
int read_frame_code(const std::uint8_t* plane, int linesize, int plane_width, int plane_height, int width,
                    int height);

/// Lowers FFmpeg's log level to errors only (x264 and friends print their
/// statistics otherwise). Process-wide.
void quiet_media_logs();

}  // namespace wick
