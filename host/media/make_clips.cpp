// The toy clip and image generator behind `wick make-clips`: frames drawn in
// RGB, converted with swscale, encoded with libavcodec and muxed with
// libavformat. Every file is written to FILE.tmp and renamed when complete.

#include "media/make_clips.hpp"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/error.h>
#include <libavutil/imgutils.h>
#include <libavutil/log.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace wick {
namespace {

namespace fs = std::filesystem;

// ---- errors and cleanup ----

std::string av_error_string(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  if (av_strerror(err, buf, sizeof buf) < 0) std::snprintf(buf, sizeof buf, "error %d", err);
  return buf;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("make-clips: " + path + ": " + what);
}

int check(int ret, const std::string& path, const char* what) {
  if (ret < 0) fail(path, std::string(what) + " failed: " + av_error_string(ret));
  return ret;
}

// FILE.tmp while writing; removed unless commit() renamed it to FILE. Declare
// it before anything that holds the file open, so that is closed first.
struct TempFile {
  std::string path, tmp;
  bool done = false;
  explicit TempFile(std::string p) : path(std::move(p)), tmp(path + ".tmp") {}
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  void commit() {
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) fail(path, "cannot rename " + tmp + ": " + ec.message());
    done = true;
  }
  ~TempFile() {
    if (done) return;
    std::error_code ec;
    fs::remove(tmp, ec);
  }
};

// Writes data to path via path.tmp, renamed when complete.
void write_file(const std::string& path, const void* data, std::size_t size) {
  TempFile tmp(path);
  std::FILE* f = std::fopen(tmp.tmp.c_str(), "wb");
  if (!f) fail(path, "cannot open " + tmp.tmp + " for writing: " + std::strerror(errno));
  const bool wrote = std::fwrite(data, 1, size, f) == size;
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !wrote) fail(path, "writing " + tmp.tmp + " failed: " + std::strerror(wrote ? errno : write_errno));
  tmp.commit();
}

struct CodecCtxFree {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameFree {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketFree {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsFree {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};
struct OutputFree {
  void operator()(AVFormatContext* oc) const {
    if (oc->pb && !(oc->oformat->flags & AVFMT_NOFILE)) avio_closep(&oc->pb);
    avformat_free_context(oc);
  }
};
struct DictFree {
  AVDictionary* d = nullptr;
  ~DictFree() { av_dict_free(&d); }
};

using CodecCtxPtr = std::unique_ptr<AVCodecContext, CodecCtxFree>;
using FramePtr = std::unique_ptr<AVFrame, FrameFree>;
using PacketPtr = std::unique_ptr<AVPacket, PacketFree>;
using SwsPtr = std::unique_ptr<SwsContext, SwsFree>;
using OutputPtr = std::unique_ptr<AVFormatContext, OutputFree>;

// ---- content ----

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

const std::vector<std::string> kClassNames = {"circle", "square", "triangle", "cross", "ring", "diamond"};

struct Colour {
  const char* name;
  std::uint8_t r, g, b;
};
constexpr std::array<Colour, 8> kColours = {{{"red", 225, 35, 35},
                                             {"green", 40, 205, 60},
                                             {"blue", 55, 95, 240},
                                             {"yellow", 240, 220, 40},
                                             {"magenta", 215, 50, 205},
                                             {"cyan", 40, 215, 225},
                                             {"orange", 250, 140, 25},
                                             {"white", 245, 245, 245}}};
constexpr std::array<const char*, 4> kDirections = {"right", "left", "down", "up"};

// Everything a clip's pictures depend on, drawn from (shape, seed).
struct Look {
  int shape = 0;
  std::uint8_t bg[3] = {0, 0, 0};
  int colour = 0;
  int direction = 0;
  double phase = 0;  // where along its path the shape starts, 0..0.5 of the path
  double cross = 0;  // where across its path, 0..1
};

Look look_for(int shape, std::uint64_t seed) {
  std::uint64_t s = seed * 0x2545f4914f6cdd1dULL + static_cast<std::uint64_t>(shape) + 1;
  Look l;
  l.shape = shape;
  // dark, muted backgrounds, so every shape colour stands out
  for (auto& c : l.bg) c = static_cast<std::uint8_t>(15 + splitmix(s) % 90);
  l.colour = static_cast<int>(splitmix(s) % kColours.size());
  l.direction = static_cast<int>(splitmix(s) % kDirections.size());
  l.phase = static_cast<double>(splitmix(s) % 1000) / 2000.0;
  l.cross = static_cast<double>(splitmix(s) % 1000) / 999.0;
  return l;
}

std::string describe(const Look& l, bool moving) {
  const std::string colour = kColours[l.colour].name;
  std::string t = (colour[0] == 'o' ? "an " : "a ") + colour + " " + kClassNames[l.shape];
  if (moving) t += std::string(" moving ") + kDirections[l.direction];
  return t;
}

bool inside(int shape, double dx, double dy, double r) {
  const double ax = std::abs(dx), ay = std::abs(dy), d2 = dx * dx + dy * dy;
  switch (shape) {
    case 0: return d2 <= r * r;                                   // circle
    case 1: return ax <= 0.8 * r && ay <= 0.8 * r;                // square
    case 2: return dy >= -r && dy <= r && ax <= (dy + r) * 0.5;   // triangle, apex up
    case 3: return (ax <= r / 3 && ay <= r) || (ay <= r / 3 && ax <= r);  // cross
    case 4: return d2 <= r * r && d2 >= 0.55 * 0.55 * r * r;     // ring
    default: return ax + ay <= r;                                 // diamond
  }
}

// Position along a back-and-forth path of length span.
double ping_pong(double p, double span) {
  if (span <= 0) return 0;
  p = std::fmod(p, 2 * span);
  return p <= span ? p : 2 * span - p;
}

constexpr double kSpeed = 3.0;  // pixels per frame

// Draws frame `index` into rgb (width*height*3, tightly packed). With
// with_code the top rows carry the index bar code and the shape stays below.
void draw(std::vector<std::uint8_t>& rgb, int width, int height, const Look& l, std::int64_t index,
          bool with_code) {
  rgb.resize(static_cast<std::size_t>(width) * height * 3);
  for (std::size_t i = 0; i < rgb.size(); i += 3) {
    rgb[i] = l.bg[0];
    rgb[i + 1] = l.bg[1];
    rgb[i + 2] = l.bg[2];
  }
  const auto g = frame_code_geometry(width, height);
  const int top = with_code ? g.block_height + 2 : 0;
  const double r = std::max(4, std::min(width, height - top) / 6);
  const double x_lo = r + 1, x_hi = width - r - 2, y_lo = top + r + 1, y_hi = height - r - 2;
  const bool horizontal = l.direction < 2;
  const double along_span = horizontal ? x_hi - x_lo : y_hi - y_lo;
  double along = ping_pong(l.phase * along_span + kSpeed * static_cast<double>(index), along_span);
  if (l.direction % 2 == 1) along = along_span - along;  // left, up
  double cx, cy;
  if (horizontal) {
    cx = x_lo + along;
    cy = y_lo + l.cross * (y_hi - y_lo);
  } else {
    cx = x_lo + l.cross * (x_hi - x_lo);
    cy = y_lo + along;
  }
  const Colour& c = kColours[l.colour];
  const int y0 = std::max(top, static_cast<int>(cy - r - 1)), y1 = std::min(height - 1, static_cast<int>(cy + r + 1));
  const int x0 = std::max(0, static_cast<int>(cx - r - 1)), x1 = std::min(width - 1, static_cast<int>(cx + r + 1));
  for (int y = y0; y <= y1; ++y)
    for (int x = x0; x <= x1; ++x)
      if (inside(l.shape, x + 0.5 - cx, y + 0.5 - cy, r)) {
        auto* p = &rgb[(static_cast<std::size_t>(y) * width + x) * 3];
        p[0] = c.r, p[1] = c.g, p[2] = c.b;
      }
  if (!with_code) return;
  const int code = static_cast<int>(index & 0xff);
  for (int b = 0; b < g.blocks; ++b) {
    const std::uint8_t v = (code >> (g.blocks - 1 - b)) & 1 ? 255 : 0;
    for (int y = 0; y < g.block_height; ++y)
      std::fill_n(&rgb[(static_cast<std::size_t>(y) * width + b * g.block_width) * 3], g.block_width * 3, v);
  }
}

// ---- encoding ----

struct EncoderChoice {
  const char* encoder;
  AVPixelFormat pix_fmt;  // what the encoder is told
  bool full_range;        // yuvj: convert to full-range yuv420p and label it yuvj420p
};

EncoderChoice encoder_for(const std::string& codec, const std::string& path) {
  if (codec == "h264" || codec == "libx264") return {"libx264", AV_PIX_FMT_YUV420P, false};
  if (codec == "mpeg4") return {"mpeg4", AV_PIX_FMT_YUV420P, false};
  if (codec == "mjpeg") return {"mjpeg", AV_PIX_FMT_YUVJ420P, true};
  if (codec == "vp9" || codec == "libvpx-vp9") return {"libvpx-vp9", AV_PIX_FMT_YUV420P, false};
  fail(path, "unknown codec '" + codec + "' (expected h264, mpeg4, mjpeg or vp9)");
}

// Converts tightly packed RGB24 into an encoder's frame.
struct Converter {
  SwsPtr sws;
  Converter(int width, int height, AVPixelFormat dst, bool full_range, const std::string& path) {
    const AVPixelFormat sws_dst = full_range ? AV_PIX_FMT_YUV420P : dst;
    sws.reset(sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, sws_dst,
                             SWS_BICUBIC | SWS_ACCURATE_RND | SWS_BITEXACT, nullptr, nullptr, nullptr));
    if (!sws) fail(path, "sws_getContext failed");
    if (full_range && sws_dst != AV_PIX_FMT_RGB24) {
      const int* coeffs = sws_getCoefficients(SWS_CS_ITU601);
      check(sws_setColorspaceDetails(sws.get(), coeffs, 1, coeffs, 1, 0, 1 << 16, 1 << 16), path,
            "sws_setColorspaceDetails");
    }
  }
  void operator()(const std::vector<std::uint8_t>& rgb, int width, int height, AVFrame* f) const {
    const std::uint8_t* src[1] = {rgb.data()};
    const int stride[1] = {width * 3};
    sws_scale(sws.get(), src, stride, 0, height, f->data, f->linesize);
  }
};

FramePtr alloc_frame(int width, int height, AVPixelFormat fmt, const std::string& path) {
  FramePtr f(av_frame_alloc());
  if (!f) fail(path, "av_frame_alloc failed");
  f->format = fmt;
  f->width = width;
  f->height = height;
  check(av_frame_get_buffer(f.get(), 0), path, "av_frame_get_buffer");
  return f;
}

void check_size(int width, int height, const std::string& path) {
  if (width < 64 || height < 48 || width > 8192 || height > 8192 || width % 2 || height % 2)
    fail(path, "size " + std::to_string(width) + "x" + std::to_string(height) +
                   " is not an even size from 64x48 to 8192x8192");
}

}  // namespace

const std::vector<std::string>& clip_class_names() { return kClassNames; }

FrameCodeGeometry frame_code_geometry(int width, int height) {
  return FrameCodeGeometry{width / FrameCodeGeometry::blocks, std::max(6, height / 10)};
}

int read_frame_code(const std::uint8_t* plane, int linesize, int plane_width, int plane_height, int width,
                    int height) {
  const auto g = frame_code_geometry(width, height);
  const double sx = static_cast<double>(plane_width) / width, sy = static_cast<double>(plane_height) / height;
  const int y = std::min(plane_height - 1, static_cast<int>(g.block_height * 0.5 * sy));
  int code = 0;
  for (int b = 0; b < g.blocks; ++b) {
    const int x = std::min(plane_width - 1, static_cast<int>((b + 0.5) * g.block_width * sx));
    code = (code << 1) | (plane[static_cast<std::size_t>(y) * linesize + x] > 128 ? 1 : 0);
  }
  return code;
}

void quiet_media_logs() { av_log_set_level(AV_LOG_ERROR); }

void write_clip(const ClipSpec& s) {
  const std::string& path = s.path;
  if (path.empty()) throw std::invalid_argument("make-clips: write_clip needs a path");
  check_size(s.width, s.height, path);
  if (s.frames < 1) fail(path, "frames must be at least 1");
  if (s.fps < 1 || s.fps > 1000) fail(path, "fps must be 1..1000");
  if (s.shape < 0 || s.shape >= static_cast<int>(kClassNames.size())) fail(path, "shape must be 0..5");
  if (s.gop < 1) fail(path, "gop must be at least 1");
  if (s.rotation % 90 != 0) fail(path, "rotation must be a multiple of 90 degrees");
  const EncoderChoice ec = encoder_for(s.codec, path);
  const AVCodec* codec = avcodec_find_encoder_by_name(ec.encoder);
  if (!codec) fail(path, std::string("this FFmpeg has no ") + ec.encoder + " encoder");

  TempFile tmp(path);  // destroyed last: the file is closed before it is removed
  AVFormatContext* raw_oc = nullptr;
  if (const int ret = avformat_alloc_output_context2(&raw_oc, nullptr, nullptr, path.c_str()); ret < 0)
    fail(path, "no container format for this file name's extension (" + av_error_string(ret) + ")");
  OutputPtr oc(raw_oc);
  oc->flags |= AVFMT_FLAG_BITEXACT;  // no version strings or random ids: reproducible bytes

  CodecCtxPtr enc(avcodec_alloc_context3(codec));
  if (!enc) fail(path, "avcodec_alloc_context3 failed");
  enc->width = s.width;
  enc->height = s.height;
  enc->pix_fmt = ec.pix_fmt;
  enc->sample_aspect_ratio = AVRational{1, 1};
  if (s.variable_frame_rate) {
    enc->time_base = AVRational{1, 100};
  } else {
    enc->time_base = AVRational{1, s.fps};
    enc->framerate = AVRational{s.fps, 1};
  }
  enc->gop_size = s.gop;
  enc->max_b_frames = s.max_b_frames;
  enc->thread_count = 1;  // single-threaded encoders give the same bytes every time
  enc->flags |= AV_CODEC_FLAG_BITEXACT;
  if (ec.full_range) enc->color_range = AVCOL_RANGE_JPEG;
  if (oc->oformat->flags & AVFMT_GLOBALHEADER) enc->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  DictFree opts;
  const std::string enc_name = ec.encoder;
  if (enc_name == "libx264") {
    av_dict_set(&opts.d, "preset", "veryfast", 0);
    av_dict_set(&opts.d, "crf", "18", 0);
    av_dict_set(&opts.d, "x264-params", "scenecut=0", 0);  // keyframes every gop frames, no more
  } else if (enc_name == "mpeg4" || enc_name == "mjpeg") {
    enc->flags |= AV_CODEC_FLAG_QSCALE;
    enc->global_quality = 3 * FF_QP2LAMBDA;
  } else if (enc_name == "libvpx-vp9") {
    enc->bit_rate = 0;
    av_dict_set(&opts.d, "crf", "24", 0);
    av_dict_set(&opts.d, "deadline", "good", 0);
    av_dict_set(&opts.d, "cpu-used", "5", 0);
    av_dict_set(&opts.d, "row-mt", "0", 0);
  }
  check(avcodec_open2(enc.get(), codec, &opts.d), path, (std::string("opening the ") + ec.encoder + " encoder").c_str());

  AVStream* st = avformat_new_stream(oc.get(), nullptr);
  if (!st) fail(path, "avformat_new_stream failed");
  st->time_base = enc->time_base;
  if (!s.variable_frame_rate) st->avg_frame_rate = st->r_frame_rate = AVRational{s.fps, 1};
  check(avcodec_parameters_from_context(st->codecpar, enc.get()), path, "avcodec_parameters_from_context");
  if (s.rotation != 0) {
    constexpr std::size_t kSize = 9 * sizeof(std::int32_t);
#if LIBAVCODEC_VERSION_INT >= AV_VERSION_INT(60, 29, 100)
    AVPacketSideData* sd = av_packet_side_data_new(&st->codecpar->coded_side_data, &st->codecpar->nb_coded_side_data,
                                                   AV_PKT_DATA_DISPLAYMATRIX, kSize, 0);
    std::uint8_t* matrix = sd ? sd->data : nullptr;
#else
    std::uint8_t* matrix = av_stream_new_side_data(st, AV_PKT_DATA_DISPLAYMATRIX, kSize);
#endif
    if (!matrix) fail(path, "cannot add the display matrix");
    av_display_rotation_set(reinterpret_cast<std::int32_t*>(matrix), s.rotation);
  }

  if (!(oc->oformat->flags & AVFMT_NOFILE))
    check(avio_open(&oc->pb, tmp.tmp.c_str(), AVIO_FLAG_WRITE), path, ("opening " + tmp.tmp + " for writing").c_str());
  check(avformat_write_header(oc.get(), nullptr), path, "writing the header");

  FramePtr frame = alloc_frame(s.width, s.height, ec.pix_fmt, path);
  if (ec.full_range) frame->color_range = AVCOL_RANGE_JPEG;
  PacketPtr pkt(av_packet_alloc());
  if (!pkt) fail(path, "av_packet_alloc failed");
  const Converter convert(s.width, s.height, ec.pix_fmt, ec.full_range, path);
  const Look look = look_for(s.shape, s.seed);
  std::map<std::int64_t, std::int64_t> durations;  // pts -> duration, in enc->time_base

  auto drain = [&] {
    for (;;) {
      const int ret = avcodec_receive_packet(enc.get(), pkt.get());
      if (ret == AVERROR(EAGAIN) || ret == AVERROR_EOF) return;
      check(ret, path, "encoding");
      if (auto it = durations.find(pkt->pts); it != durations.end()) pkt->duration = it->second;
      pkt->stream_index = st->index;
      av_packet_rescale_ts(pkt.get(), enc->time_base, st->time_base);
      check(av_interleaved_write_frame(oc.get(), pkt.get()), path, "writing a packet");
    }
  };

  static constexpr std::array<int, 4> kVfrTicks = {1, 3, 1, 2};
  std::vector<std::uint8_t> rgb;
  std::int64_t pts = 0;
  for (int i = 0; i < s.frames; ++i) {
    check(av_frame_make_writable(frame.get()), path, "av_frame_make_writable");
    draw(rgb, s.width, s.height, look, i, true);
    convert(rgb, s.width, s.height, frame.get());
    const std::int64_t duration = s.variable_frame_rate ? kVfrTicks[i % kVfrTicks.size()] : 1;
    frame->pts = pts;
    durations[pts] = duration;
    pts += duration;
    check(avcodec_send_frame(enc.get(), frame.get()), path, "encoding");
    drain();
  }
  check(avcodec_send_frame(enc.get(), nullptr), path, "flushing the encoder");
  drain();
  check(av_write_trailer(oc.get()), path, "writing the trailer");
  if (oc->pb) check(avio_closep(&oc->pb), path, ("closing " + tmp.tmp).c_str());
  oc.reset();
  tmp.commit();
}

void write_image(const std::string& path, int width, int height, int shape, std::uint64_t seed) {
  check_size(width, height, path);
  if (shape < 0 || shape >= static_cast<int>(kClassNames.size())) fail(path, "shape must be 0..5");
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  const char* encoder_name;
  AVPixelFormat fmt;
  bool full_range = false;
  if (ext == ".png") {
    encoder_name = "png", fmt = AV_PIX_FMT_RGB24;
  } else if (ext == ".jpg" || ext == ".jpeg") {
    encoder_name = "mjpeg", fmt = AV_PIX_FMT_YUVJ420P, full_range = true;
  } else if (ext == ".webp") {
    encoder_name = "libwebp", fmt = AV_PIX_FMT_YUV420P;
  } else {
    fail(path, "unknown image extension '" + ext + "' (expected .png, .jpg or .webp)");
  }
  const AVCodec* codec = avcodec_find_encoder_by_name(encoder_name);
  if (!codec) fail(path, std::string("this FFmpeg has no ") + encoder_name + " encoder");
  CodecCtxPtr enc(avcodec_alloc_context3(codec));
  if (!enc) fail(path, "avcodec_alloc_context3 failed");
  enc->width = width;
  enc->height = height;
  enc->pix_fmt = fmt;
  enc->time_base = AVRational{1, 25};
  enc->thread_count = 1;
  enc->flags |= AV_CODEC_FLAG_BITEXACT;
  if (full_range) enc->color_range = AVCOL_RANGE_JPEG;
  DictFree opts;
  if (ext != ".png" && ext != ".webp") {
    enc->flags |= AV_CODEC_FLAG_QSCALE;
    enc->global_quality = 2 * FF_QP2LAMBDA;
  }
  if (ext == ".webp") av_dict_set(&opts.d, "quality", "90", 0);
  check(avcodec_open2(enc.get(), codec, &opts.d), path, (std::string("opening the ") + encoder_name + " encoder").c_str());

  FramePtr frame = alloc_frame(width, height, fmt, path);
  if (full_range) frame->color_range = AVCOL_RANGE_JPEG;
  std::vector<std::uint8_t> rgb;
  draw(rgb, width, height, look_for(shape, seed), 0, false);
  if (fmt == AV_PIX_FMT_RGB24) {
    for (int y = 0; y < height; ++y)
      std::copy_n(&rgb[static_cast<std::size_t>(y) * width * 3], width * 3, frame->data[0] + y * frame->linesize[0]);
  } else {
    Converter(width, height, fmt, full_range, path)(rgb, width, height, frame.get());
  }
  frame->pts = 0;
  PacketPtr pkt(av_packet_alloc());
  if (!pkt) fail(path, "av_packet_alloc failed");
  std::vector<std::uint8_t> bytes;
  auto drain = [&] {
    for (;;) {
      const int ret = avcodec_receive_packet(enc.get(), pkt.get());
      if (ret == AVERROR(EAGAIN) || ret == AVERROR_EOF) return;
      check(ret, path, "encoding");
      bytes.insert(bytes.end(), pkt->data, pkt->data + pkt->size);
      av_packet_unref(pkt.get());
    }
  };
  check(avcodec_send_frame(enc.get(), frame.get()), path, "encoding");
  drain();
  check(avcodec_send_frame(enc.get(), nullptr), path, "flushing the encoder");
  drain();
  if (bytes.empty()) fail(path, "the encoder gave no data");

  write_file(path, bytes.data(), bytes.size());
}

namespace {

struct ManifestRow {
  std::string path;
  int label;
  std::string text;
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += c;
  }
  return out + "\"";
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (const char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

void write_text(const std::string& path, const std::string& text) { write_file(path, text.data(), text.size()); }

// Writes dir/manifest.csv and dir/manifest.jsonl; returns their paths.
std::vector<std::string> write_manifests(const fs::path& dir, const std::vector<ManifestRow>& rows) {
  std::string csv = "path,label,text\n", jsonl;
  for (const auto& r : rows) {
    csv += csv_field(r.path) + "," + std::to_string(r.label) + "," + csv_field(r.text) + "\n";
    jsonl += "{\"path\": " + json_string(r.path) + ", \"label\": " + std::to_string(r.label) +
             ", \"text\": " + json_string(r.text) + "}\n";
  }
  const std::string c = (dir / "manifest.csv").string(), j = (dir / "manifest.jsonl").string();
  write_text(c, csv);
  write_text(j, jsonl);
  return {c, j};
}

void make_dirs(const fs::path& p) {
  std::error_code ec;
  fs::create_directories(p, ec);
  if (ec) fail(p.string(), "cannot create the folder: " + ec.message());
}

std::uint64_t mix(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  std::uint64_t s = seed ^ (a * 0x100000001b3ULL + 0x51ed2701ULL) ^ (b * 0xc2b2ae3d27d4eb4fULL);
  return splitmix(s);
}

}  // namespace

ClipSetReport make_clip_set(const std::string& dir_str, const ClipSetOptions& o) {
  const int max_classes = static_cast<int>(kClassNames.size());
  if (o.classes < 1 || o.classes > max_classes)
    throw std::invalid_argument("make-clips: classes must be 1.." + std::to_string(max_classes));
  if (o.per_class < 1) throw std::invalid_argument("make-clips: per_class must be at least 1");
  if (o.width < 64 || o.height < 48 || o.width > 8192 || o.height > 8192 || o.width % 2 || o.height % 2)
    throw std::invalid_argument("make-clips: size must be even, from 64x48 to 8192x8192");
  if (o.fps < 1 || o.fps > 1000) throw std::invalid_argument("make-clips: fps must be 1..1000");
  if (!(o.seconds > 0) || o.seconds * o.fps > 1e6)
    throw std::invalid_argument("make-clips: seconds must be positive (and at most 1e6 frames)");
  const int frames = std::max(1, static_cast<int>(std::lround(o.seconds * o.fps)));

  const fs::path dir(dir_str);
  ClipSetReport rep;
  make_dirs(dir);

  std::vector<ManifestRow> rows;
  for (int c = 0; c < o.classes; ++c) {
    const std::string& name = kClassNames[static_cast<std::size_t>(c)];
    // clips under videos/<class>/ (root = DIR/videos for video_folder), listed
    // in DIR/manifest.* with paths relative to DIR
    make_dirs(dir / "videos" / name);
    for (int k = 0; k < o.per_class; ++k) {
      ClipSpec s;
      s.seed = mix(o.seed, static_cast<std::uint64_t>(c), static_cast<std::uint64_t>(k));
      const std::string rel = "videos/" + name + "/" + name + "_" + std::to_string(k) + ".mp4";
      s.path = (dir / rel).string();
      s.width = o.width, s.height = o.height, s.fps = o.fps, s.frames = frames, s.shape = c;
      write_clip(s);
      rep.files.push_back(s.path);
      rows.push_back({rel, c, describe(look_for(c, s.seed), true)});
      ++rep.clips;
    }
  }
  for (auto& f : write_manifests(dir, rows)) rep.files.push_back(std::move(f));

  if (o.images) {
    const fs::path idir = dir / "images";
    static constexpr std::array<const char*, 4> kExts = {".png", ".png", ".jpg", ".webp"};
    const int per_class = std::max(1, o.per_class / 2);
    std::vector<ManifestRow> irows;
    for (int c = 0; c < o.classes; ++c) {
      const std::string& name = kClassNames[static_cast<std::size_t>(c)];
      make_dirs(idir / name);
      for (int k = 0; k < per_class; ++k) {
        const std::uint64_t seed = mix(o.seed ^ 0x1a9e5ULL, static_cast<std::uint64_t>(c), static_cast<std::uint64_t>(k));
        const std::string rel = name + "/" + name + "_" + std::to_string(k) + kExts[static_cast<std::size_t>(k) % kExts.size()];
        const std::string path = (idir / rel).string();
        write_image(path, o.width, o.height, c, seed);
        rep.files.push_back(path);
        irows.push_back({rel, c, describe(look_for(c, seed), false)});
        ++rep.images;
      }
    }
    for (auto& f : write_manifests(idir, irows)) rep.files.push_back(std::move(f));
  }

  if (o.extras) {
    const fs::path edir = dir / "extras";
    make_dirs(edir);
    std::vector<ClipSpec> extras;
    auto base = [&](const char* file, int shape) {
      ClipSpec s;
      s.path = (edir / file).string();
      s.width = o.width, s.height = o.height, s.fps = o.fps, s.frames = frames;
      s.shape = shape % o.classes;
      s.seed = mix(o.seed ^ 0xe7a5ULL, static_cast<std::uint64_t>(extras.size()), 0);
      return s;
    };
    {
      auto s = base("mpeg4.avi", 0);
      s.codec = "mpeg4";
      extras.push_back(s);
    }
    {
      auto s = base("mjpeg.mkv", 1);
      s.codec = "mjpeg";
      extras.push_back(s);
    }
    if (avcodec_find_encoder_by_name("libvpx-vp9")) {
      auto s = base("vp9.webm", 2);
      s.codec = "vp9";
      extras.push_back(s);
    }
    {
      auto s = base("vfr.mp4", 3);
      s.variable_frame_rate = true;
      extras.push_back(s);
    }
    {
      auto s = base("rotated.mp4", 4);
      s.rotation = 90;
      extras.push_back(s);
    }
    {
      auto s = base("bframes.mp4", 5);
      s.max_b_frames = 2;
      extras.push_back(s);
    }
    {
      auto s = base("short.mp4", 0);
      s.frames = 3;
      extras.push_back(s);
    }
    {
      auto s = base("long.mp4", 1);
      s.width = 160, s.height = 120, s.fps = 25, s.frames = 60 * 25;
      extras.push_back(s);
    }
    for (const auto& s : extras) {
      write_clip(s);
      rep.files.push_back(s.path);
      ++rep.extras;
    }
  }
  return rep;
}

}  // namespace wick
