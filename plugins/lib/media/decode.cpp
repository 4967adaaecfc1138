#include "lib/media/decode.hpp"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/imgutils.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>

namespace wick::media {
namespace {

using Clock = std::chrono::steady_clock;

std::string av_error(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(err, buf, sizeof buf);
  return buf;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

struct Deadline {
  Clock::time_point at{};
  bool active = false;
  bool passed() const { return active && Clock::now() > at; }
};

// FFmpeg's own log lines ("moov atom not found") would interleave with the
// training output; wick reports each failure itself, with the file's name.
// WICK_FFMPEG_LOG=1 keeps them.
void quiet_ffmpeg() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("WICK_FFMPEG_LOG");
    if (!v || !*v || std::string(v) == "0") av_log_set_level(AV_LOG_QUIET);
  });
}

int interrupt_cb(void* opaque) { return static_cast<Deadline*>(opaque)->passed() ? 1 : 0; }

// One open file: demuxer, decoder, a packet and two frames.
struct Source {
  std::string path;
  AVFormatContext* fmt = nullptr;
  AVCodecContext* dec = nullptr;
  AVPacket* pkt = nullptr;
  int si = -1;
  AVStream* st = nullptr;
  Deadline deadline;
  bool eof = false;        // demuxer drained
  bool flushed = false;    // decoder drained
  int decoded = 0;
  int seeks = 0;
  bool image = false;  // decode_image's: a file that does not open is said not to be an image

  // A file FFmpeg cannot take a picture stream from: an image's message says
  // so first (a text file named .png reaches the decoder's checks as a
  // stream without a frame size).
  [[noreturn]] void not_media(const std::string& why, const std::string& image_why = "") const {
    fail(path, image ? "not a decodable image (" + (image_why.empty() ? why : image_why) + ")" : why);
  }

  ~Source() {
    av_packet_free(&pkt);
    avcodec_free_context(&dec);
    avformat_close_input(&fmt);
  }

  void check_time() const {
    if (deadline.passed()) fail(path, "decoding took longer than the time limit");
  }

  void open(const Request& req) {
    quiet_ffmpeg();
    if (req.time_limit > 0) {
      deadline.active = true;
      deadline.at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(req.time_limit));
    }
    fmt = avformat_alloc_context();
    if (!fmt) fail(path, "out of memory");
    fmt->interrupt_callback.callback = interrupt_cb;
    fmt->interrupt_callback.opaque = &deadline;
    int err = avformat_open_input(&fmt, path.c_str(), nullptr, nullptr);
    if (err < 0) {
      fmt = nullptr;  // freed by avformat_open_input on failure
      check_time();   // interrupted by the time limit, not a bad file
      if (err != AVERROR_INVALIDDATA) fail(path, "cannot open: " + av_error(err));  // missing, unreadable
      not_media("cannot open: " + av_error(err), "FFmpeg recognises no format in it");
    }
    // MP4/MOV headers describe their streams completely (sizes, rates,
    // durations, the sample index): probing by decoding is skipped there.
    bool complete_header = false;
    if (std::strstr(fmt->iformat->name, "mp4") != nullptr) {
      for (unsigned i = 0; i < fmt->nb_streams; ++i) {
        const AVStream* v = fmt->streams[i];
        if (v->codecpar->codec_type == AVMEDIA_TYPE_VIDEO && v->codecpar->width > 0 && v->duration > 0 &&
            v->avg_frame_rate.num > 0 && avformat_index_get_entries_count(v) > 0)
          complete_header = true;  // fragmented MP4 (no sample index) is probed
      }
    }
    err = complete_header ? 0 : avformat_find_stream_info(fmt, nullptr);
    check_time();
    if (err < 0) not_media("not a readable media file: " + av_error(err));
    check_time();
    const AVCodec* codec = nullptr;
    si = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, &codec, 0);
    if (si == AVERROR_STREAM_NOT_FOUND) not_media("has no video stream", "FFmpeg finds no picture in it");
    if (si < 0 || !codec) not_media("no decoder for its video stream: " + av_error(si));
    st = fmt->streams[si];
    const auto* par = st->codecpar;
    if (par->width <= 0 || par->height <= 0)
      not_media("video stream without a frame size", "FFmpeg reads no picture size from it");
    if (static_cast<std::int64_t>(par->width) * par->height > req.max_pixels)
      fail(path, "frames of " + std::to_string(par->width) + "x" + std::to_string(par->height) +
                     " exceed the limit of " + std::to_string(req.max_pixels) + " pixels (max_pixels)");
    // the other streams are not read at all
    for (unsigned i = 0; i < fmt->nb_streams; ++i)
      if (static_cast<int>(i) != si) fmt->streams[i]->discard = AVDISCARD_ALL;
    dec = avcodec_alloc_context3(codec);
    if (!dec) fail(path, "out of memory");
    if ((err = avcodec_parameters_to_context(dec, par)) < 0) fail(path, "bad codec parameters: " + av_error(err));
    dec->thread_count = std::max(1, req.threads);
    dec->thread_type = FF_THREAD_FRAME | FF_THREAD_SLICE;
    if ((err = avcodec_open2(dec, codec, nullptr)) < 0) fail(path, "cannot open the decoder: " + av_error(err));
    pkt = av_packet_alloc();
    if (!pkt) fail(path, "out of memory");
  }

  // Next decoded frame into `f`; false at the end of the stream.
  bool next(AVFrame* f) {
    for (;;) {
      check_time();
      int err = avcodec_receive_frame(dec, f);
      if (err == 0) {
        ++decoded;
        if (static_cast<std::int64_t>(f->width) * f->height > 0) return true;
        av_frame_unref(f);
        continue;
      }
      if (err == AVERROR_EOF) return false;
      if (err != AVERROR(EAGAIN)) fail(path, "decoding failed: " + av_error(err));
      if (eof) {
        if (flushed) return false;
        avcodec_send_packet(dec, nullptr);
        flushed = true;
        continue;
      }
      err = av_read_frame(fmt, pkt);
      if (err < 0) {
        if (deadline.passed()) fail(path, "decoding took longer than the time limit");
        eof = true;  // end of file, or a truncated one: decode what there is
        continue;
      }
      if (pkt->stream_index == si) {
        err = avcodec_send_packet(dec, pkt);
        // a damaged packet is skipped, as players do; the frames around it still decode
        if (err < 0 && err != AVERROR(EAGAIN) && err != AVERROR_INVALIDDATA) {
          av_packet_unref(pkt);
          fail(path, "decoding failed: " + av_error(err));
        }
      }
      av_packet_unref(pkt);
    }
  }

  void seek(std::int64_t ts) {
    ++seeks;
    const int err = av_seek_frame(fmt, si, ts, AVSEEK_FLAG_BACKWARD);
    if (err < 0) {
      // some containers cannot seek: read again from the start
      if (avformat_seek_file(fmt, si, INT64_MIN, 0, 0, 0) < 0) fail(path, "cannot seek: " + av_error(err));
    }
    avcodec_flush_buffers(dec);
    eof = flushed = false;
  }

  // The timestamp of the keyframe at or before ts from the container's index,
  // or AV_NOPTS_VALUE when there is no index.
  std::int64_t keyframe_before(std::int64_t ts) const {
    const int idx = av_index_search_timestamp(st, ts, AVSEEK_FLAG_BACKWARD);
    if (idx < 0) return AV_NOPTS_VALUE;
    const AVIndexEntry* e = avformat_index_get_entry(st, idx);
    return e ? e->timestamp : AV_NOPTS_VALUE;
  }
};

std::int64_t frame_pts(const AVFrame* f) {
  return f->best_effort_timestamp != AV_NOPTS_VALUE ? f->best_effort_timestamp : f->pts;
}

std::int64_t frame_duration(const AVFrame* f) {
#if LIBAVUTIL_VERSION_INT >= AV_VERSION_INT(57, 30, 100)
  return f->duration;
#else
  return f->pkt_duration;
#endif
}

int rotation_of(const AVStream* st) {
  const std::uint8_t* m = av_stream_get_side_data(st, AV_PKT_DATA_DISPLAYMATRIX, nullptr);
  if (!m) return 0;
  const double ccw = av_display_rotation_get(reinterpret_cast<const std::int32_t*>(m));
  if (std::isnan(ccw)) return 0;
  // clockwise degrees, snapped to quarter turns as players do
  int cw = static_cast<int>(std::lround(-ccw / 90.0)) * 90;
  cw %= 360;
  if (cw < 0) cw += 360;
  return cw;
}

struct Rect {
  double x = 0, y = 0, w = 0, h = 0;
};

// Where the output comes from (a rectangle of the displayed picture) and
// where it goes (a rectangle of the output, the rest black for letterbox).
struct Plan {
  Rect src;            // in display coordinates
  int dst_x = 0, dst_y = 0, dst_w = 0, dst_h = 0;
  int out_w = 0, out_h = 0;
};

Plan plan_geometry(const Request& r, int dw, int dh, std::mt19937_64& rng) {
  Plan p;
  const double W = dw, H = dh;
  auto full = [&](int ow, int oh) {
    p.src = {0, 0, W, H};
    p.out_w = p.dst_w = ow;
    p.out_h = p.dst_h = oh;
  };
  if (r.crop == Crop::RandomResized) {
    // torchvision's RandomResizedCrop: area fraction and aspect ratio at random
    std::uniform_real_distribution<double> area_u(r.scale_min, r.scale_max);
    std::uniform_real_distribution<double> logr(std::log(r.ratio_min), std::log(r.ratio_max));
    bool found = false;
    for (int attempt = 0; attempt < 10 && !found; ++attempt) {
      const double area = W * H * area_u(rng);
      const double ratio = std::exp(logr(rng));
      const double w = std::round(std::sqrt(area * ratio)), h = std::round(std::sqrt(area / ratio));
      if (w > 0 && h > 0 && w <= W && h <= H) {
        std::uniform_int_distribution<int> ux(0, static_cast<int>(W - w)), uy(0, static_cast<int>(H - h));
        p.src = {static_cast<double>(ux(rng)), static_cast<double>(uy(rng)), w, h};
        found = true;
      }
    }
    if (!found) {  // the largest centre crop within the ratio range
      const double in_ratio = W / H;
      double w = W, h = H;
      if (in_ratio < r.ratio_min) h = std::round(W / r.ratio_min);
      else if (in_ratio > r.ratio_max) w = std::round(H * r.ratio_max);
      p.src = {(W - w) / 2, (H - h) / 2, w, h};
    }
    p.out_w = p.dst_w = r.width;
    p.out_h = p.dst_h = r.height;
    return p;
  }
  switch (r.resize) {
    case Resize::Exact:
      full(r.width, r.height);
      if (r.crop == Crop::Center) {}  // the whole picture already fills the output
      return p;
    case Resize::Letterbox: {
      const double f = std::min(r.width / W, r.height / H);
      p.src = {0, 0, W, H};
      p.out_w = r.width;
      p.out_h = r.height;
      p.dst_w = std::max(1, static_cast<int>(std::lround(W * f)));
      p.dst_h = std::max(1, static_cast<int>(std::lround(H * f)));
      p.dst_x = (p.out_w - p.dst_w) / 2;
      p.dst_y = (p.out_h - p.dst_h) / 2;
      return p;
    }
    case Resize::ShorterSide: {
      const double side = std::min(r.width, r.height);
      const double f = side / std::min(W, H);
      if (r.crop == Crop::None) {
        full(std::max(1, static_cast<int>(std::lround(W * f))), std::max(1, static_cast<int>(std::lround(H * f))));
        return p;
      }
      // centre crop of the output size, taken from the picture before scaling
      const double cw = std::min(W, r.width / f), ch = std::min(H, r.height / f);
      p.src = {std::floor((W - cw) / 2), std::floor((H - ch) / 2), cw, ch};
      p.out_w = p.dst_w = r.width;
      p.out_h = p.dst_h = r.height;
      return p;
    }
  }
  return p;
}

// A display-coordinate rectangle in the stored (unrotated) picture.
Rect to_source(const Rect& d, int rotation, int sw, int sh) {
  switch (rotation) {
    case 90: return {d.y, sh - d.x - d.w, d.h, d.w};  // displayed = stored turned clockwise
    case 180: return {sw - d.x - d.w, sh - d.y - d.h, d.w, d.h};
    case 270: return {sw - d.y - d.h, d.x, d.h, d.w};
    default: return d;
  }
}

// Crops the frame in place by moving its plane pointers (no copy), aligned to
// the chroma subsampling. Returns false for formats that cannot be cropped
// this way (palettes, bitstreams): those are scaled whole, then cropped.
bool crop_frame(AVFrame* f, int x, int y, int w, int h) {
  const AVPixFmtDescriptor* d = av_pix_fmt_desc_get(static_cast<AVPixelFormat>(f->format));
  if (!d || (d->flags & (AV_PIX_FMT_FLAG_PAL | AV_PIX_FMT_FLAG_BITSTREAM | AV_PIX_FMT_FLAG_HWACCEL))) return false;
  int step[4] = {0, 0, 0, 0};
  for (int c = 0; c < d->nb_components; ++c)
    if (step[d->comp[c].plane] == 0) step[d->comp[c].plane] = d->comp[c].step;
  const bool yuv = !(d->flags & AV_PIX_FMT_FLAG_RGB) && d->nb_components >= 3 && d->comp[1].plane != d->comp[0].plane;
  for (int p = 0; p < 4 && f->data[p]; ++p) {
    const bool chroma = yuv && (p == 1 || p == 2);
    const int sx = chroma ? d->log2_chroma_w : 0, sy = chroma ? d->log2_chroma_h : 0;
    f->data[p] += static_cast<std::ptrdiff_t>(y >> sy) * f->linesize[p] + static_cast<std::ptrdiff_t>(x >> sx) * step[p];
  }
  f->width = w;
  f->height = h;
  return true;
}

class Converter {
 public:
  ~Converter() { sws_freeContext(sws_); }

  // Writes the frame's part `plan.src` (display coordinates) into `out`
  // (3 x out_h x out_w planar RGB, already zeroed where letterbox pads).
  void convert(AVFrame* f, const Plan& plan, int rotation, bool flip, std::uint8_t* out, const std::string& path) {
    const int sw = f->width, sh = f->height;
    const AVPixFmtDescriptor* d = av_pix_fmt_desc_get(static_cast<AVPixelFormat>(f->format));
    const int ax = d ? (1 << d->log2_chroma_w) : 1, ay = d ? (1 << d->log2_chroma_h) : 1;
    Rect s = to_source(plan.src, rotation, sw, sh);
    int x = std::clamp(static_cast<int>(std::lround(s.x)), 0, sw - 1);
    int y = std::clamp(static_cast<int>(std::lround(s.y)), 0, sh - 1);
    x -= x % ax;
    y -= y % ay;
    int w = std::clamp(static_cast<int>(std::lround(s.w)), 1, sw - x);
    int h = std::clamp(static_cast<int>(std::lround(s.h)), 1, sh - y);
    // the scaled size in stored orientation
    const bool quarter = rotation == 90 || rotation == 270;
    const int tw = quarter ? plan.dst_h : plan.dst_w, th = quarter ? plan.dst_w : plan.dst_h;
    std::uint8_t* planes[3];
    const bool direct = rotation == 0 && !flip && plan.dst_w == plan.out_w && plan.dst_h == plan.out_h;
    const std::size_t plane = static_cast<std::size_t>(tw) * th;
    if (!direct) tmp_.resize(3 * plane);
    std::uint8_t* base = direct ? out : tmp_.data();
    // swscale's planar RGB is G, B, R
    planes[0] = base + plane;
    planes[1] = base + 2 * plane;
    planes[2] = base;
    int lines[3] = {tw, tw, tw};
    AVFrame* src = f;
    AVFrame* whole = nullptr;
    if (!crop_frame(f, x, y, w, h)) {
      // scale whole, then crop: only for palette and bitstream formats
      whole = av_frame_alloc();
      whole->format = AV_PIX_FMT_RGB24;
      whole->width = sw;
      whole->height = sh;
      if (!whole || av_frame_get_buffer(whole, 0) < 0) {
        av_frame_free(&whole);
        fail(path, "out of memory");
      }
      SwsContext* c = sws_getContext(sw, sh, static_cast<AVPixelFormat>(f->format), sw, sh, AV_PIX_FMT_RGB24,
                                     SWS_POINT, nullptr, nullptr, nullptr);
      if (!c) {
        av_frame_free(&whole);
        fail(path, "cannot convert pixel format " + std::string(d ? d->name : "?"));
      }
      sws_scale(c, f->data, f->linesize, 0, sh, whole->data, whole->linesize);
      sws_freeContext(c);
      crop_frame(whole, x, y, w, h);
      src = whole;
    }
    sws_ = sws_getCachedContext(sws_, src->width, src->height, static_cast<AVPixelFormat>(src->format), tw, th,
                                AV_PIX_FMT_GBRP, SWS_BILINEAR, nullptr, nullptr, nullptr);
    if (!sws_) {
      av_frame_free(&whole);
      fail(path, "cannot scale pixel format " + std::string(d ? d->name : "?"));
    }
    sws_scale(sws_, src->data, src->linesize, 0, src->height, planes, lines);
    av_frame_free(&whole);
    if (direct) return;
    // rotate / flip / place into the output
    for (int c = 0; c < 3; ++c) {
      const std::uint8_t* in = tmp_.data() + c * plane;
      std::uint8_t* o = out + static_cast<std::size_t>(c) * plan.out_w * plan.out_h;
      for (int oy = 0; oy < plan.dst_h; ++oy) {
        std::uint8_t* row = o + static_cast<std::size_t>(oy + plan.dst_y) * plan.out_w + plan.dst_x;
        for (int ox0 = 0; ox0 < plan.dst_w; ++ox0) {
          const int ox = flip ? plan.dst_w - 1 - ox0 : ox0;
          int sx = ox, sy = oy;  // in the scaled stored picture (tw x th)
          if (rotation == 90) { sx = oy; sy = th - 1 - ox; }
          else if (rotation == 180) { sx = tw - 1 - ox; sy = th - 1 - oy; }
          else if (rotation == 270) { sx = tw - 1 - oy; sy = ox; }
          row[ox0] = in[static_cast<std::size_t>(sy) * tw + sx];
        }
      }
    }
  }

 private:
  SwsContext* sws_ = nullptr;
  std::vector<std::uint8_t> tmp_;
};

double to_seconds(std::int64_t ts, AVRational tb) { return static_cast<double>(ts) * av_q2d(tb); }

}  // namespace

std::vector<double> sample_times(const Request& req, double start, double duration, double frame_rate,
                                 std::mt19937_64& rng) {
  if (duration <= 0) duration = 1.0 / std::max(frame_rate, 1.0);
  const double fr = frame_rate > 0 ? frame_rate : 25.0;
  const double n_frames = std::max(1.0, std::floor(duration * fr + 0.5));
  if (req.max_frames == 0) {
    // every stride-th frame at `fps` to the end: as many as the clip holds
    if (req.sampling != Sampling::Stride)
      throw std::runtime_error("max_frames = 0 (every frame at the stride) needs sampling = stride");
    const double rate = req.fps > 0 ? req.fps : fr;
    const double step = req.stride / rate;
    // half a sample short of the end counts as the end: headers round durations
    const double usable = duration - 0.5 / std::max(fr, rate);
    double t0 = 0;
    const double reach = std::min(step, usable);  // a random start within the first stride
    if (req.random_start && reach > 0) t0 = std::uniform_real_distribution<double>(0.0, reach)(rng);
    const double count = usable > t0 ? std::floor((usable - t0) / step + 1e-9) + 1 : 1;
    if (count > kMaxAllFrames)
      throw std::runtime_error("holds " + std::to_string(static_cast<long long>(count)) + " frames at stride " +
                               std::to_string(req.stride) + " (max_frames = 0 takes at most " +
                               std::to_string(kMaxAllFrames) + "; raise stride, lower fps or set max_frames)");
    std::vector<double> t(static_cast<std::size_t>(count));
    for (std::size_t k = 0; k < t.size(); ++k) t[k] = start + t0 + static_cast<double>(k) * step;
    return t;
  }
  const int T = req.max_frames;
  std::vector<double> t(static_cast<std::size_t>(T));
  if (req.sampling == Sampling::Stride) {
    const double rate = req.fps > 0 ? req.fps : fr;
    const double step = req.stride / rate;
    const double span = step * (T - 1);
    double t0 = start;
    if (req.random_start && duration > span) {
      std::uniform_real_distribution<double> u(0.0, duration - span);
      t0 = start + u(rng);
    }
    for (int k = 0; k < T; ++k) {
      double x = t0 - start + k * step;
      if (x >= duration) {
        if (req.pad == Pad::Loop) x = std::fmod(x, duration);
        else x = duration - 0.5 / fr;  // the last frame, repeated
      }
      t[static_cast<std::size_t>(k)] = start + std::max(0.0, x);
    }
    return t;
  }
  if (req.pad == Pad::Loop && n_frames < T) {
    // fewer frames than wanted: all of them in order, then again
    for (int k = 0; k < T; ++k) t[static_cast<std::size_t>(k)] = start + (std::fmod(k, n_frames) + 0.5) / fr;
    return t;
  }
  const double seg = duration / T;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int k = 0; k < T; ++k) {
    const double within = req.sampling == Sampling::RandomSegment ? u(rng) : 0.5;
    t[static_cast<std::size_t>(k)] = start + (k + within) * seg;
  }
  return t;
}

namespace {

using FramePtr = std::unique_ptr<AVFrame, void (*)(AVFrame*)>;
FramePtr alloc_frame() { return FramePtr(av_frame_alloc(), [](AVFrame* f) { av_frame_free(&f); }); }

// The two decoded frames around a target time: `have`, the latest at or
// before it, and `next`, the first after it; a target's frame is `have`
// once `next` is past it.
class FrameWindow {
 public:
  FrameWindow(Source& s, const std::string& path) : s_(s), have_(alloc_frame()), next_(alloc_frame()) {
    if (!have_ || !next_) fail(path, "out of memory");
  }

  // The frame held answers if the next one is past the target.
  AVFrame* held_for(std::int64_t ts) const {
    const bool held = has_have_ && frame_pts(have_.get()) <= ts && has_next_ && frame_pts(next_.get()) > ts;
    return held ? have_.get() : nullptr;
  }

  // Seek when the keyframe before the target lies past the frame we hold
  // (the frames between would be decoded for nothing), or when the target
  // is behind us. Without an index: when the target is over 2 s ahead.
  bool should_seek(std::int64_t ts, std::int64_t start_ts, AVRational tb) const {
    const std::int64_t key = s_.keyframe_before(ts);
    if (!has_have_ && !has_next_) return s_.decoded > 0 || (key != AV_NOPTS_VALUE && key > start_ts);
    const std::int64_t held = has_next_ ? frame_pts(next_.get()) : frame_pts(have_.get());
    if (has_have_ && ts < frame_pts(have_.get())) return true;
    if (key != AV_NOPTS_VALUE) return key > held;
    return to_seconds(ts - held, tb) > 2.0;
  }

  void seek(std::int64_t ts) {
    s_.seek(ts);
    has_have_ = has_next_ = false;
  }

  // Decodes up to the frame on screen at ts; at the end of the stream (or
  // of a truncated file) the last frame stays on screen; nullptr when no
  // frame was decoded at all.
  AVFrame* advance_to(std::int64_t ts) {
    for (;;) {
      if (has_next_) {
        if (frame_pts(next_.get()) <= ts) {
          av_frame_unref(have_.get());
          av_frame_move_ref(have_.get(), next_.get());
          has_have_ = true;
          has_next_ = false;
          continue;
        }
        // next is past the target: `have` is the frame on screen at ts (or,
        // before the first frame, the first frame itself)
        return has_have_ ? have_.get() : next_.get();
      }
      // The frame held already covers the target when its duration (from
      // the container) reaches past it: no need to decode the next frame to
      // find out. Without a duration the next frame decides.
      if (has_have_) {
        const std::int64_t dur = frame_duration(have_.get());
        if (dur > 0 && frame_pts(have_.get()) + dur > ts) return have_.get();
      }
      if (!s_.next(next_.get())) break;
      if (frame_pts(next_.get()) == AV_NOPTS_VALUE) next_->best_effort_timestamp = has_have_ ? frame_pts(have_.get()) + 1 : 0;
      has_next_ = true;
    }
    return has_have_ ? have_.get() : nullptr;
  }

 private:
  Source& s_;
  FramePtr have_, next_;
  bool has_have_ = false, has_next_ = false;
};

// The video stream's clock: its time base, first timestamp and length.
struct StreamClock {
  AVRational tb;
  std::int64_t start_ts;
  double start, duration, rate;
};

StreamClock clock_of(const Source& s) {
  StreamClock c;
  c.tb = s.st->time_base;
  c.start_ts = s.st->start_time != AV_NOPTS_VALUE ? s.st->start_time : 0;
  c.duration = s.st->duration != AV_NOPTS_VALUE ? to_seconds(s.st->duration, c.tb)
               : s.fmt->duration != AV_NOPTS_VALUE ? static_cast<double>(s.fmt->duration) / AV_TIME_BASE : 0;
  AVRational fr = s.st->avg_frame_rate.num > 0 ? s.st->avg_frame_rate : s.st->r_frame_rate;
  c.rate = fr.num > 0 && fr.den > 0 ? av_q2d(fr) : 25.0;
  c.start = to_seconds(c.start_ts, c.tb);
  return c;
}

}  // namespace

Frames decode_video(const std::string& path, const Request& req, std::mt19937_64& rng) {
  if (req.max_frames < 0) fail(path, "max_frames must be >= 0");
  Source s;
  s.path = path;
  s.open(req);
  const StreamClock clock = clock_of(s);
  const int rotation = rotation_of(s.st);
  std::vector<double> want;
  try {
    want = sample_times(req, clock.start, clock.duration, clock.rate, rng);
  } catch (const std::runtime_error& e) {
    fail(path, e.what());
  }

  // geometry from the displayed size
  const int sw = s.st->codecpar->width, sh = s.st->codecpar->height;
  const bool quarter = rotation == 90 || rotation == 270;
  const Plan plan = plan_geometry(req, quarter ? sh : sw, quarter ? sw : sh, rng);

  Frames out;
  out.t = static_cast<int>(want.size());
  out.h = plan.out_h;
  out.w = plan.out_w;
  out.rotation = rotation;
  out.duration = clock.duration;
  const std::size_t per = 3ULL * out.h * out.w;
  out.data.assign(per * out.t, 0);
  out.times.assign(out.t, 0.0);

  // targets in decoding order
  std::vector<int> order(want.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return want[a] < want[b]; });

  FrameWindow window(s, path);
  FramePtr work = alloc_frame();
  if (!work) fail(path, "out of memory");
  Converter conv;
  int last_slot = -1;
  auto emit = [&](int slot, AVFrame* f) {
    // convert from a reference: cropping moves the plane pointers
    av_frame_unref(work.get());
    if (av_frame_ref(work.get(), f) < 0) fail(path, "out of memory");
    conv.convert(work.get(), plan, rotation, req.flip, out.data.data() + per * slot, path);
    out.times[slot] = to_seconds(frame_pts(f), clock.tb);
    last_slot = slot;
  };
  auto repeat = [&](int slot, int from) {
    std::memcpy(out.data.data() + per * slot, out.data.data() + per * from, per);
    out.times[slot] = out.times[from];
  };

  for (std::size_t k = 0; k < order.size(); ++k) {
    const int slot = order[k];
    if (k > 0 && want[slot] == want[order[k - 1]] && last_slot >= 0) {  // the same time again
      repeat(slot, order[k - 1]);
      continue;
    }
    const std::int64_t ts =
        clock.start_ts + static_cast<std::int64_t>(std::floor((want[slot] - clock.start) / av_q2d(clock.tb) + 1e-6));
    if (AVFrame* f = window.held_for(ts)) {
      emit(slot, f);
      continue;
    }
    if (window.should_seek(ts, clock.start_ts, clock.tb)) window.seek(ts);
    if (AVFrame* f = window.advance_to(ts)) {
      emit(slot, f);
    } else if (last_slot >= 0) {
      repeat(slot, last_slot);
    } else {
      fail(path, "no frame could be decoded");
    }
  }
  out.frames_decoded = s.decoded;
  out.seeks = s.seeks;
  return out;
}

Frames decode_image(const std::string& path, const Request& req, std::mt19937_64& rng) {
  Source s;
  s.path = path;
  s.image = true;
  s.open(req);
  std::unique_ptr<AVFrame, void (*)(AVFrame*)> f(av_frame_alloc(), [](AVFrame* x) { av_frame_free(&x); });
  if (!f) fail(path, "out of memory");
  if (!s.next(f.get())) fail(path, "no picture could be decoded");
  const int rotation = rotation_of(s.st);
  const bool quarter = rotation == 90 || rotation == 270;
  const Plan plan = plan_geometry(req, quarter ? f->height : f->width, quarter ? f->width : f->height, rng);
  Frames out;
  out.t = 1;
  out.h = plan.out_h;
  out.w = plan.out_w;
  out.rotation = rotation;
  out.data.assign(3ULL * out.h * out.w, 0);
  out.times = {0.0};
  Converter conv;
  conv.convert(f.get(), plan, rotation, req.flip, out.data.data(), path);
  out.frames_decoded = s.decoded;
  return out;
}

}  // namespace wick::media
