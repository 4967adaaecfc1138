// wick make-clips: the toy video data set, read back with libavformat and
// libavcodec.

#include <gtest/gtest.h>

#include "media/make_clips.hpp"
#include "../../test_util.hpp"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using wick::test::TempDir;

namespace {

// An opened input with its first video stream.
struct Input {
  AVFormatContext* fmt = nullptr;
  AVStream* st = nullptr;
  explicit Input(const std::string& path) {
    if (avformat_open_input(&fmt, path.c_str(), nullptr, nullptr) < 0) throw std::runtime_error("cannot open " + path);
    if (avformat_find_stream_info(fmt, nullptr) < 0) throw std::runtime_error("no stream info in " + path);
    const int i = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    if (i < 0) throw std::runtime_error("no video stream in " + path);
    st = fmt->streams[i];
  }
  ~Input() { avformat_close_input(&fmt); }
  Input(const Input&) = delete;
  Input& operator=(const Input&) = delete;
};

struct Packet {
  std::int64_t pts, dts;
};

std::vector<Packet> packets(const std::string& path, AVRational* time_base = nullptr) {
  Input in(path);
  if (time_base) *time_base = in.st->time_base;
  std::vector<Packet> out;
  AVPacket* pkt = av_packet_alloc();
  while (av_read_frame(in.fmt, pkt) >= 0) {
    if (pkt->stream_index == in.st->index) out.push_back({pkt->pts, pkt->dts});
    av_packet_unref(pkt);
  }
  av_packet_free(&pkt);
  return out;
}

// Decodes every frame of the first video stream, in presentation order, calling
// each(frame); returns the number of frames.
int decode_all(const std::string& path, const std::function<void(const AVFrame*)>& each = {}) {
  Input in(path);
  const AVCodec* codec = avcodec_find_decoder(in.st->codecpar->codec_id);
  if (!codec) throw std::runtime_error("no decoder for " + path);
  AVCodecContext* dec = avcodec_alloc_context3(codec);
  avcodec_parameters_to_context(dec, in.st->codecpar);
  dec->thread_count = 1;
  if (avcodec_open2(dec, codec, nullptr) < 0) throw std::runtime_error("cannot open decoder for " + path);
  AVPacket* pkt = av_packet_alloc();
  AVFrame* frame = av_frame_alloc();
  int n = 0;
  auto receive = [&] {
    while (avcodec_receive_frame(dec, frame) >= 0) {
      if (each) each(frame);
      ++n;
      av_frame_unref(frame);
    }
  };
  while (av_read_frame(in.fmt, pkt) >= 0) {
    if (pkt->stream_index == in.st->index) {
      EXPECT_GE(avcodec_send_packet(dec, pkt), 0) << path;
      receive();
    }
    av_packet_unref(pkt);
  }
  avcodec_send_packet(dec, nullptr);
  receive();
  av_frame_free(&frame);
  av_packet_free(&pkt);
  avcodec_free_context(&dec);
  return n;
}

// The frame's bar code, read after resizing it to 112 pixels wide.
int code_at_112(const AVFrame* f) {
  const int w = 112, h = 112 * f->height / f->width;
  SwsContext* sws = sws_getContext(f->width, f->height, static_cast<AVPixelFormat>(f->format), w, h, AV_PIX_FMT_GRAY8,
                                   SWS_BILINEAR, nullptr, nullptr, nullptr);
  std::vector<std::uint8_t> gray(static_cast<std::size_t>(w) * h);
  std::uint8_t* dst[1] = {gray.data()};
  const int stride[1] = {w};
  sws_scale(sws, f->data, f->linesize, 0, f->height, dst, stride);
  sws_freeContext(sws);
  return wick::read_frame_code(gray.data(), w, w, h, f->width, f->height);
}

std::vector<std::string> lines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::string bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool have_vp9() { return avcodec_find_encoder_by_name("libvpx-vp9") != nullptr; }

// One small set for the whole suite: 2 classes x 8 clips of 10 frames.
class MakeClips : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    wick::quiet_media_logs();
    dir_ = new TempDir;
    wick::ClipSetOptions o;
    o.classes = 2;
    o.per_class = 8;
    o.seconds = 0.4;
    o.seed = 7;
    report_ = new wick::ClipSetReport(wick::make_clip_set(dir_->path.string(), o));
  }
  static void TearDownTestSuite() {
    delete report_;
    delete dir_;
  }
  static fs::path at(const std::string& rel) { return dir_->path / rel; }
  static TempDir* dir_;
  static wick::ClipSetReport* report_;
};
TempDir* MakeClips::dir_ = nullptr;
wick::ClipSetReport* MakeClips::report_ = nullptr;

}  // namespace

TEST_F(MakeClips, LayoutAndManifests) {
  EXPECT_EQ(report_->clips, 16);
  EXPECT_EQ(report_->images, 8);
  EXPECT_EQ(report_->extras, have_vp9() ? 8 : 7);
  for (const auto& f : report_->files) EXPECT_TRUE(fs::is_regular_file(f)) << f;
  for (const auto& e : fs::recursive_directory_iterator(dir_->path))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();

  const auto csv = lines(at("manifest.csv"));
  ASSERT_EQ(csv.size(), 17u);
  EXPECT_EQ(csv[0], "path,label,text");
  EXPECT_EQ(csv[1].rfind("videos/circle/circle_0.mp4,0,a ", 0), 0u) << csv[1];
  EXPECT_NE(csv[1].find(" circle moving "), std::string::npos) << csv[1];
  EXPECT_EQ(csv[16].rfind("videos/square/square_7.mp4,1,", 0), 0u) << csv[16];
  for (std::size_t i = 1; i < csv.size(); ++i) {
    const auto path = csv[i].substr(0, csv[i].find(','));
    EXPECT_TRUE(fs::is_regular_file(at(path))) << path;
  }
  const auto jsonl = lines(at("manifest.jsonl"));
  ASSERT_EQ(jsonl.size(), 16u);
  EXPECT_EQ(jsonl[0].rfind("{\"path\": \"videos/circle/circle_0.mp4\", \"label\": 0, \"text\": \"a", 0), 0u) << jsonl[0];

  const auto icsv = lines(at("images/manifest.csv"));
  ASSERT_EQ(icsv.size(), 9u);
  EXPECT_EQ(icsv[0], "path,label,text");
  std::set<std::string> exts;
  for (std::size_t i = 1; i < icsv.size(); ++i) {
    const auto path = icsv[i].substr(0, icsv[i].find(','));
    exts.insert(fs::path(path).extension().string());
    ASSERT_TRUE(fs::is_regular_file(at("images/" + path))) << path;
    int w = 0, h = 0;
    EXPECT_EQ(decode_all(at("images/" + path).string(), [&](const AVFrame* f) { w = f->width, h = f->height; }), 1)
        << path;
    EXPECT_EQ(w, 160);
    EXPECT_EQ(h, 120);
  }
  EXPECT_EQ(exts, (std::set<std::string>{".png", ".jpg", ".webp"}));
  EXPECT_EQ(lines(at("images/manifest.jsonl")).size(), 8u);
}

TEST_F(MakeClips, CodecsAndFrameCounts) {
  struct Want {
    const char* file;
    AVCodecID codec;
    int frames;
  };
  std::vector<Want> want = {{"videos/circle/circle_0.mp4", AV_CODEC_ID_H264, 10},
                            {"videos/square/square_7.mp4", AV_CODEC_ID_H264, 10},
                            {"extras/mpeg4.avi", AV_CODEC_ID_MPEG4, 10},
                            {"extras/mjpeg.mkv", AV_CODEC_ID_MJPEG, 10},
                            {"extras/vfr.mp4", AV_CODEC_ID_H264, 10},
                            {"extras/rotated.mp4", AV_CODEC_ID_H264, 10},
                            {"extras/bframes.mp4", AV_CODEC_ID_H264, 10},
                            {"extras/short.mp4", AV_CODEC_ID_H264, 3},
                            {"extras/long.mp4", AV_CODEC_ID_H264, 1500}};
  if (have_vp9()) want.push_back({"extras/vp9.webm", AV_CODEC_ID_VP9, 10});
  else EXPECT_FALSE(fs::exists(at("extras/vp9.webm")));
  for (const auto& w : want) {
    const std::string path = at(w.file).string();
    {
      Input in(path);
      EXPECT_EQ(in.st->codecpar->codec_id, w.codec) << w.file;
      EXPECT_EQ(in.st->codecpar->width, 160) << w.file;
      EXPECT_EQ(in.st->codecpar->height, 120) << w.file;
      if (std::string(w.file) != "extras/vfr.mp4") {
        EXPECT_EQ(av_cmp_q(in.st->avg_frame_rate, AVRational{25, 1}), 0) << w.file;
        EXPECT_EQ(av_cmp_q(in.st->r_frame_rate, AVRational{25, 1}), 0) << w.file;
      }
    }
    EXPECT_EQ(decode_all(path), w.frames) << w.file;
  }
}

TEST_F(MakeClips, RotatedHasDisplayMatrix) {
  Input in(at("extras/rotated.mp4").string());
#if LIBAVCODEC_VERSION_INT >= AV_VERSION_INT(60, 29, 100)
  const AVPacketSideData* sd = av_packet_side_data_get(in.st->codecpar->coded_side_data,
                                                       in.st->codecpar->nb_coded_side_data, AV_PKT_DATA_DISPLAYMATRIX);
  const std::uint8_t* matrix = sd ? sd->data : nullptr;
#else
  const std::uint8_t* matrix = av_stream_get_side_data(in.st, AV_PKT_DATA_DISPLAYMATRIX, nullptr);
#endif
  ASSERT_NE(matrix, nullptr);
  // written as av_display_rotation_set(m, 90): turn 90 degrees clockwise to show
  EXPECT_DOUBLE_EQ(av_display_rotation_get(reinterpret_cast<const std::int32_t*>(matrix)), -90.0);

  Input plain(at("extras/short.mp4").string());
#if LIBAVCODEC_VERSION_INT >= AV_VERSION_INT(60, 29, 100)
  EXPECT_EQ(av_packet_side_data_get(plain.st->codecpar->coded_side_data, plain.st->codecpar->nb_coded_side_data,
                                    AV_PKT_DATA_DISPLAYMATRIX),
            nullptr);
#else
  EXPECT_EQ(av_stream_get_side_data(plain.st, AV_PKT_DATA_DISPLAYMATRIX, nullptr), nullptr);
#endif
}

TEST_F(MakeClips, VariableFrameRateHasIrregularGaps) {
  AVRational tb{};
  auto p = packets(at("extras/vfr.mp4").string(), &tb);
  ASSERT_EQ(p.size(), 10u);
  std::vector<std::int64_t> pts;
  for (const auto& x : p) pts.push_back(x.pts);
  std::sort(pts.begin(), pts.end());
  std::vector<std::int64_t> gaps;  // in hundredths of a second
  for (std::size_t i = 1; i < pts.size(); ++i) {
    ASSERT_GT(pts[i], pts[i - 1]);
    gaps.push_back(av_rescale_q(pts[i] - pts[i - 1], tb, AVRational{1, 100}));
  }
  EXPECT_EQ(gaps, (std::vector<std::int64_t>{1, 3, 1, 2, 1, 3, 1, 2, 1}));
}

TEST_F(MakeClips, BFramesReorder) {
  auto p = packets(at("extras/bframes.mp4").string());
  ASSERT_EQ(p.size(), 10u);
  int reordered = 0;
  for (const auto& x : p) reordered += x.pts != x.dts;
  EXPECT_GT(reordered, 0);
  // decoded in presentation order all the same
  std::vector<int> codes;
  decode_all(at("extras/bframes.mp4").string(), [&](const AVFrame* f) { codes.push_back(code_at_112(f)); });
  EXPECT_EQ(codes, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));

  auto q = packets(at("videos/circle/circle_0.mp4").string());
  for (const auto& x : q) EXPECT_EQ(x.pts, x.dts);
}

TEST_F(MakeClips, FrameIndexBarCode) {
  std::vector<std::string> files = {"videos/circle/circle_3.mp4", "extras/mpeg4.avi", "extras/mjpeg.mkv",
                                    "extras/vfr.mp4",      "extras/rotated.mp4", "extras/long.mp4"};
  if (have_vp9()) files.push_back("extras/vp9.webm");
  for (const auto& file : files) {
    int k = 0;
    decode_all(at(file).string(), [&](const AVFrame* f) {
      EXPECT_EQ(code_at_112(f), k % 256) << file << " frame " << k;
      // and at the native size, from the luma plane
      EXPECT_EQ(wick::read_frame_code(f->data[0], f->linesize[0], f->width, f->height, f->width, f->height), k % 256)
          << file << " frame " << k;
      ++k;
    });
  }
  const auto g = wick::frame_code_geometry(160, 120);
  EXPECT_EQ(g.block_width, 20);
  EXPECT_EQ(g.block_height, 12);
}

TEST_F(MakeClips, Deterministic) {
  TempDir d;
  wick::ClipSpec s;
  s.frames = 12;
  s.seed = 3;
  s.shape = 4;
  s.max_b_frames = 2;
  s.path = (d.path / "a.mp4").string();
  wick::write_clip(s);
  s.path = (d.path / "b.mp4").string();
  wick::write_clip(s);
  EXPECT_EQ(bytes(d.path / "a.mp4"), bytes(d.path / "b.mp4"));
  wick::write_image((d.path / "a.png").string(), 96, 64, 2, 5);
  wick::write_image((d.path / "b.png").string(), 96, 64, 2, 5);
  EXPECT_EQ(bytes(d.path / "a.png"), bytes(d.path / "b.png"));
}

TEST_F(MakeClips, ErrorsNameTheFileAndLeaveNothing) {
  wick::ClipSetOptions o;
  o.classes = 1;
  o.per_class = 1;
  const std::string msg = wick::test::error_of([&] { wick::make_clip_set("/proc/nope/x", o); });
  EXPECT_NE(msg.find("/proc/nope/x"), std::string::npos) << msg;

  wick::ClipSpec s;
  s.path = "/proc/nope/x.mp4";
  const std::string msg2 = wick::test::error_of([&] { wick::write_clip(s); });
  EXPECT_NE(msg2.find("/proc/nope/x.mp4"), std::string::npos) << msg2;
  EXPECT_NE(msg2.find("No such file or directory"), std::string::npos) << msg2;

  // The muxer refuses MJPEG in WebM after the file was opened: no file, no .tmp.
  TempDir d;
  s.path = (d.path / "bad.webm").string();
  s.codec = "mjpeg";
  const std::string msg3 = wick::test::error_of([&] { wick::write_clip(s); });
  EXPECT_NE(msg3.find(s.path), std::string::npos) << msg3;
  EXPECT_TRUE(fs::is_empty(d.path));

  s.codec = "theora";
  EXPECT_NE(wick::test::error_of([&] { wick::write_clip(s); }).find("unknown codec"), std::string::npos);
  EXPECT_NE(wick::test::error_of([&] { wick::write_image((d.path / "x.gif").string(), 64, 48, 0, 0); })
                .find("x.gif"),
            std::string::npos);
  o.classes = 7;
  EXPECT_THROW(wick::make_clip_set(d.path.string(), o), std::invalid_argument);
}
