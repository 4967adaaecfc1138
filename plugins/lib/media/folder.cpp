// The data set behind `video_folder` and `image_folder`: clips or images from
// a folder per class, or from a manifest (CSV or JSONL with path, label and/or
// text), decoded by FFmpeg (lib/media/decode.*) to uint8 frames, T x C x H x W (video) or C x H x W
// (image), only the frames asked for, resized while decoding.
//
// Randomness (random_segment frames, random_resized crops, flips, a random
// stride start) is drawn per sample from (seed, the run's seed, epoch, index):
// the same seeds give the same samples whatever the worker threads do.
// A file that cannot be decoded is, with on_error = "skip", named once on
// stderr, counted (the `skipped_files` attribute) and replaced by the next
// readable sample; with "fail" it ends the run with the file's name.
//
// Text columns (image-text and video-text pairs): with a `tokenizer`, each
// sample also gets input_ids = encode(prompt) + encode(text) + [end of text]
// (truncated to text_length), attention_mask (1 = real token) and labels
// (-100 on the prompt, else the ids), int64; collate pads to the longest
// sequence of the batch with the end-of-text id (labels -100, mask 0).

#include <wick/data.hpp>
#include <wick/kit/json_fields.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>

#include "lib/media/folder.hpp"

#include <wick/kit/enum_names.hpp>

#include "lib/media/decode.hpp"
#include "lib/tokenizer/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kIgnore = -100;

// The decoder's choices as the options spell them (decode.hpp, built alone
// under the sanitizers, knows no SDK).
using wick::media::Crop;
using wick::media::Pad;
using wick::media::Resize;
using wick::media::Sampling;
constexpr wick::EnumName<Sampling> kSamplingNames[] = {
    {Sampling::Uniform, "uniform"}, {Sampling::RandomSegment, "random_segment"}, {Sampling::Stride, "stride"}};
constexpr wick::EnumName<Pad> kPadNames[] = {{Pad::Repeat, "repeat"}, {Pad::Loop, "loop"}};
constexpr wick::EnumName<Resize> kResizeNames[] = {
    {Resize::ShorterSide, "shorter_side"}, {Resize::Exact, "exact"}, {Resize::Letterbox, "letterbox"}};
constexpr wick::EnumName<Crop> kCropNames[] = {
    {Crop::Center, "center"}, {Crop::RandomResized, "random_resized"}, {Crop::None, "none"}};
static_assert(wick::enum_names_distinct(kSamplingNames) && wick::enum_names_distinct(kPadNames) &&
              wick::enum_names_distinct(kResizeNames) && wick::enum_names_distinct(kCropNames));

struct Item {
  std::string path;
  std::int64_t label = -1;
  std::string text;
  std::vector<std::int64_t> ids, labels;  // with a tokenizer
};

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// splitmix64 over the seeds and the index: independent streams per sample
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One CSV line into fields (quotes with "" escapes).
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else out.back() += c;
    } else if (c == '"') quoted = true;
    else if (c == ',') out.emplace_back();
    else if (c != '\r') out.back() += c;
  }
  return out;
}

class MediaFolder : public wick::Dataset {
  // first, for the constructor: which plugin this is
  const bool video_;
  const char* const name_;  // the plugin's name, the start of every message
  const char* const key_;   // the sample's picture key

 public:
  MediaFolder(const wick::Options& o, wick::media::Kind kind)
      : video_(kind == wick::media::Kind::Video),
        name_(video_ ? "video_folder" : "image_folder"),
        key_(video_ ? "video" : "image"),
        seed_(static_cast<std::uint64_t>(o.get_int("seed"))) {
    const std::string root = o.has("root") ? o.get_string("root") : "";
    const std::string manifest = o.has("manifest") ? o.get_string("manifest") : "";
    if (root.empty() == manifest.empty())
      throw wick::Error(std::string(name_) + ": give either root (a folder per class) or manifest (CSV or JSONL)");
    req_.max_frames = video_ ? static_cast<int>(o.get_int("max_frames")) : 1;
    req_.resize = wick::parse_enum(kResizeNames, o.get_string("resize"), "resize");
    req_.crop = wick::parse_enum(kCropNames, o.get_string("crop"), "crop");
    req_.height = req_.width = static_cast<int>(o.get_int("image_size"));
    if (req_.resize == wick::media::Resize::ShorterSide && req_.crop == wick::media::Crop::None)
      variable_size_ = true;
    req_.scale_min = o.get_number("scale_min");
    req_.scale_max = o.get_number("scale_max");
    if (req_.scale_min > req_.scale_max)
      throw wick::Error(std::string(name_) + ": scale_min " + std::to_string(req_.scale_min) + " is above scale_max " +
                        std::to_string(req_.scale_max));
    flip_ = o.get_bool("flip");
    req_.threads = static_cast<int>(o.get_int("decode_threads"));
    req_.time_limit = o.get_number("time_limit");
    req_.max_pixels = o.get_int("max_pixels");
    fail_ = o.get_string("on_error") == "fail";
    if (video_) {
      const std::string s = o.get_string("sampling");
      req_.sampling = wick::parse_enum(kSamplingNames, s, "sampling");
      req_.stride = static_cast<int>(o.get_int("stride"));
      req_.fps = o.get_number("fps");
      req_.random_start = o.get_bool("random_start");
      req_.pad = wick::parse_enum(kPadNames, o.get_string("pad"), "pad");
      if (req_.max_frames == 0 && req_.sampling != wick::media::Sampling::Stride)
        throw wick::Error(std::string(name_) + ": max_frames = 0 takes every stride-th frame of each clip, which "
                          "needs sampling = \"stride\" (got sampling = \"" + s + "\"); or give max_frames >= 1");
    }
    std::vector<std::string> exts;
    for (const auto& v : o.at("extensions").as_list()) {
      const std::string& e = v.as_string();
      exts.push_back(lower(!e.empty() && e[0] == '.' ? e : "." + e));
    }
    if (!root.empty()) scan(root, exts);
    else read_manifest(manifest);
    if (items_.empty())
      throw wick::Error(std::string(name_) + ": no " + (video_ ? "clips" : "images") + " found in " +
                        (root.empty() ? manifest : root) + " (extensions searched: " + join(exts) + ")");
    if (o.has("tokenizer")) tokenize(o);
  }

  using Dataset::decode, Dataset::encode;
  std::vector<std::int64_t> encode(const std::string& s, bool add_special_tokens) const override {
    if (!tokenizer_) return Dataset::encode(s, add_special_tokens);
    return tokenizer_->encode(s, add_special_tokens);
  }
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const override {
    if (!tokenizer_) return Dataset::decode(ids, skip_special_tokens);
    return tokenizer_->decode(ids, skip_special_tokens);
  }

  std::int64_t size() const override { return static_cast<std::int64_t>(items_.size()); }

  void set_epoch(std::int64_t epoch, std::uint64_t seed) const override {
    epoch_.store(epoch);
    run_seed_.store(seed);
  }

  wick::Sample get(std::int64_t i) const override {
    const std::int64_t n = size();
    std::string first_error;
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t j = (i + k) % n;
      try {
        return load(j, i);
      } catch (const std::exception& e) {
        if (fail_) throw wick::Error(std::string(name_) + ": " + e.what());
        note_skip(items_[static_cast<std::size_t>(j)].path, e.what());
        if (first_error.empty()) first_error = e.what();
      }
    }
    throw wick::Error(std::string(name_) + ": no file could be decoded (first error: " + first_error + ")");
  }

  wick::Batch collate(const std::vector<wick::Sample>& in) const override {
    if (variable_size_ && in.size() > 1) {
      // frames (max_frames = 0) may differ in number, pictures must not differ in size
      const auto last3 = [&](const wick::Sample& s) { return s.at(key_).sizes().slice(s.at(key_).dim() - 3); };
      for (const auto& s : in)
        if (last3(s) != last3(in.front()))
          throw wick::Error(std::string(name_) + ": resize = 'shorter_side' with crop = 'none' gives pictures of "
                            "different shapes that do not stack into a batch; use crop = 'center' or micro_batch = 1");
    }
    // max_frames = 0: clips hold different frame counts; each is padded with
    // black frames to the longest of the batch (frame_times -1 there) and
    // frame_mask [B, T] (int64, 1 = a real frame) says which frames are real
    std::vector<wick::Sample> padded;
    at::Tensor frame_mask;
    if (video_ && req_.max_frames == 0) {
      std::int64_t T = 0;
      for (const auto& s : in) T = std::max(T, s.at(key_).size(0));
      frame_mask = at::zeros({static_cast<std::int64_t>(in.size()), T}, at::kLong);
      for (std::size_t b = 0; b < in.size(); ++b) {
        wick::Sample s = in[b];
        const auto n = s.at(key_).size(0);
        frame_mask[static_cast<std::int64_t>(b)].narrow(0, 0, n).fill_(1);
        if (n < T) {
          auto shape = s.at(key_).sizes().vec();
          shape[0] = T - n;
          s[key_] = at::cat({s.at(key_), at::zeros(shape, s.at(key_).options())});
          s["frame_times"] = at::cat({s.at("frame_times"), at::full({T - n}, -1.0, at::kDouble)});
        }
        padded.push_back(std::move(s));
      }
    }
    const std::vector<wick::Sample>& samples = frame_mask.defined() ? padded : in;
    wick::Batch out = collate_tokens(samples);
    if (frame_mask.defined()) out["frame_mask"] = frame_mask;
    return out;
  }

  wick::Batch collate_tokens(const std::vector<wick::Sample>& samples) const {
    if (!tokenizer_) return Dataset::collate(samples);
    // the token columns: padded to the longest of the batch, rounded up to
    // a multiple of pad_to_multiple_of within text_length (fewer distinct
    // sequence lengths; the padding follows every real token)
    std::vector<wick::Sample> rest;
    std::int64_t T = 0;
    for (const auto& s : samples) {
      T = std::max(T, s.at("input_ids").size(0));
      wick::Sample r = s;
      r.erase("input_ids"), r.erase("labels"), r.erase("attention_mask");
      rest.push_back(std::move(r));
    }
    T = std::max(T, std::min((T + pad_multiple_ - 1) / pad_multiple_ * pad_multiple_, text_length_));
    wick::Batch out = Dataset::collate(rest);
    const auto B = static_cast<std::int64_t>(samples.size());
    at::Tensor ids = at::full({B, T}, eos_, at::kLong), labels = at::full({B, T}, kIgnore, at::kLong);
    at::Tensor mask = at::zeros({B, T}, at::kLong);
    for (std::int64_t b = 0; b < B; ++b) {
      const auto& s = samples[static_cast<std::size_t>(b)];
      const auto n = s.at("input_ids").size(0);
      ids[b].narrow(0, 0, n).copy_(s.at("input_ids"));
      labels[b].narrow(0, 0, n).copy_(s.at("labels"));
      mask[b].narrow(0, 0, n).fill_(1);
    }
    out["input_ids"] = ids;
    out["labels"] = labels;
    out["attention_mask"] = mask;
    return out;
  }

  std::map<std::string, wick::Value> attributes() const override {
    auto a = base_attributes();
    if (tokenizer_) {
      a["vocab_size"] = tokenizer_->vocab_size();
      a["eos_id"] = eos_;
      a["image_token_id"] = image_token_id_;
      a["text_length"] = text_length_;
    }
    return a;
  }

 private:
  std::map<std::string, wick::Value> base_attributes() const {
    return {{"size", size()},
            {"num_classes", static_cast<std::int64_t>(classes_.size())},
            {"classes", join(classes_)},
            {"skipped_files", static_cast<std::int64_t>(skipped_.load())},
            // decoding cost so far: frames the decoder produced for the frames returned
            {"frames_decoded", static_cast<std::int64_t>(frames_decoded_.load())},
            {"frames_returned", static_cast<std::int64_t>(frames_returned_.load())},
            {"seeks", static_cast<std::int64_t>(seeks_.load())},
            {"image_size", static_cast<std::int64_t>(req_.height)},
            {"max_frames", static_cast<std::int64_t>(req_.max_frames)},
            // max_frames = 0: a clip's bytes are frame_bytes x its frame count
            {"frame_bytes", static_cast<std::int64_t>(3LL * req_.height * req_.width)},
            {"sample_bytes", static_cast<std::int64_t>(3LL * req_.max_frames * req_.height * req_.width)}};
  }

  // Tokenizes every item's text once, here: get() only copies the ids.
  void tokenize(const wick::Options& o) {
    const std::string tok = o.get_string("tokenizer");
    const std::string image_token = o.get_string("image_token");
    const std::string where = std::string(name_) + ": tokenizer '" + tok + "'";
    try {
      if (tok == "bytes") tokenizer_ = wick::text::byte_tokenizer(image_token.empty() ? std::vector<std::string>{}
                                                                                       : std::vector<std::string>{image_token});
      else tokenizer_ = wick::text::bpe_tokenizer(tok);
    } catch (const std::exception& e) {
      throw wick::Error(where + ": " + e.what() + " (expected 'bytes' or a Hugging Face tokenizer.json)");
    }
    const std::string eos = o.has("eos_token") ? o.get_string("eos_token") : wick::text::default_eos(*tokenizer_);
    eos_ = tokenizer_->token_id(eos);
    if (eos_ < 0) throw wick::Error(where + " has no end-of-text token '" + eos + "' (set eos_token)");
    image_token_id_ = image_token.empty() ? -1 : tokenizer_->token_id(image_token);
    text_length_ = o.get_int("text_length");
    pad_multiple_ = o.get_int("pad_to_multiple_of");
    const std::string prompt = o.get_string("prompt");
    const auto prompt_ids = tokenizer_->encode(prompt);
    for (auto& it : items_) {
      if (image_token_id_ < 0 && !image_token.empty() &&
          (prompt.find(image_token) != std::string::npos || it.text.find(image_token) != std::string::npos))
        throw wick::Error(where + " has no token '" + image_token + "' (the image_token in prompt or text): add it "
                          "to the tokenizer's added_tokens or set image_token");
      it.ids = prompt_ids;
      it.labels.assign(prompt_ids.size(), kIgnore);
      try {
        for (auto id : tokenizer_->encode(it.text, /*add_special_tokens=*/false)) it.ids.push_back(id), it.labels.push_back(id);
      } catch (const wick::Error& e) {
        throw wick::Error(where + ": the text of " + it.path + ": " + e.what());
      }
      it.ids.push_back(eos_);
      it.labels.push_back(eos_);
      if (static_cast<std::int64_t>(it.ids.size()) > text_length_) {
        it.ids.resize(static_cast<std::size_t>(text_length_));
        it.labels.resize(static_cast<std::size_t>(text_length_));
      }
    }
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
    return s;
  }

  void scan(const std::string& root, const std::vector<std::string>& exts) {
    std::error_code ec;
    if (!fs::is_directory(root, ec)) throw wick::Error(std::string(name_) + ": root " + root + " is not a folder");
    std::vector<fs::path> dirs;
    for (const auto& e : fs::directory_iterator(root, ec))
      if (e.is_directory()) dirs.push_back(e.path());
    std::sort(dirs.begin(), dirs.end());
    // a class folder without files is refused, as torchvision's ImageFolder
    // refuses it: skipped, it would shift every later class's label (and
    // num_classes) against the folder's names
    std::vector<std::string> empty;
    for (const auto& d : dirs) {
      std::vector<fs::path> files;
      for (const auto& e : fs::recursive_directory_iterator(d, ec))
        if (e.is_regular_file() && std::find(exts.begin(), exts.end(), lower(e.path().extension().string())) != exts.end())
          files.push_back(e.path());
      if (files.empty()) {
        empty.push_back(d.string());
        continue;
      }
      std::sort(files.begin(), files.end());
      const auto label = static_cast<std::int64_t>(classes_.size());
      classes_.push_back(d.filename().string());
      for (const auto& f : files) items_.push_back({f.string(), label, ""});
    }
    if (!empty.empty() && !classes_.empty())
      throw wick::Error(std::string(name_) + ": the class folder" + (empty.size() > 1 ? "s " : " ") + join(empty) +
                        (empty.size() > 1 ? " hold" : " holds") + " no " + (video_ ? "clips" : "images") +
                        " (extensions searched: " + join(exts) +
                        "), expected files in every folder under root (each folder is a class)");
  }

  void read_manifest(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw wick::Error(std::string(name_) + ": cannot read the manifest " + path);
    const fs::path base = fs::path(path).parent_path();
    const bool jsonl = lower(fs::path(path).extension().string()) == ".jsonl";
    std::string line;
    std::vector<std::string> header;
    int line_no = 0;
    std::map<std::string, std::int64_t> label_names;
    auto add = [&](std::string p, const std::string& label, std::string text) {
      if (p.empty()) throw wick::Error(path + ":" + std::to_string(line_no) + ": a row without a path");
      Item it;
      it.path = fs::path(p).is_absolute() ? p : (base / p).string();
      it.text = std::move(text);
      if (!label.empty()) {
        char* end = nullptr;
        const long long v = std::strtoll(label.c_str(), &end, 10);
        if (end && *end == '\0') {
          it.label = v;
        } else {  // a class name
          auto [pos, inserted] = label_names.emplace(label, static_cast<std::int64_t>(label_names.size()));
          it.label = pos->second;
        }
      }
      items_.push_back(std::move(it));
    };
    while (std::getline(in, line)) {
      ++line_no;
      if (line.empty() || line == "\r") continue;
      if (jsonl) {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          throw wick::Error(path + ":" + std::to_string(line_no) + ": not JSON (" + wick::json_error_text(e) + ")");
        }
        if (!j.is_object() || !j.contains("path") || !j["path"].is_string())
          throw wick::Error(path + ":" + std::to_string(line_no) + ": expected an object with a \"path\" string");
        // label: a class index (an integer >= 0) or a class name; text: a string
        const wick::JsonFields f(j, path + ":" + std::to_string(line_no));
        std::string label;
        if (f.has("label")) {
          const auto& l = *f.find("label");
          if (l.is_string()) label = l.get<std::string>();
          else if (l.is_number_unsigned()) label = std::to_string(l.get<std::uint64_t>());
          else f.bad("label", "a class index (an integer >= 0) or a class name (a string)");
        }
        add(j["path"].get<std::string>(), label, f.string("text", ""));
      } else {
        auto f = csv_fields(line);
        if (header.empty()) {
          header = f;
          if (std::find(header.begin(), header.end(), "path") == header.end())
            throw wick::Error(path + ":1: the CSV header needs a 'path' column (and 'label' and/or 'text'), got: " + line);
          continue;
        }
        std::map<std::string, std::string> row;
        for (std::size_t c = 0; c < header.size() && c < f.size(); ++c) row[header[c]] = f[c];
        add(row["path"], row["label"], row["text"]);
      }
    }
    std::int64_t max_label = -1;
    for (const auto& it : items_) max_label = std::max(max_label, it.label);
    if (!label_names.empty()) {
      classes_.resize(label_names.size());
      for (const auto& [name, id] : label_names) classes_[static_cast<std::size_t>(id)] = name;
    } else {
      for (std::int64_t c = 0; c <= max_label; ++c) classes_.push_back(std::to_string(c));
    }
  }

  wick::Sample load(std::int64_t j, std::int64_t i) const {
    const Item& it = items_[static_cast<std::size_t>(j)];
    std::mt19937_64 rng(mix(seed_ ^ mix(run_seed_.load() ^ mix(static_cast<std::uint64_t>(epoch_.load()) ^
                                                                mix(static_cast<std::uint64_t>(i))))));
    wick::media::Request r = req_;
    if (flip_) r.flip = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
    wick::media::Frames f = video_ ? wick::media::decode_video(it.path, r, rng) : wick::media::decode_image(it.path, r, rng);
    frames_decoded_ += f.frames_decoded;
    frames_returned_ += f.t;
    seeks_ += f.seeks;
    at::Tensor t = video_ ? at::empty({f.t, 3, f.h, f.w}, at::kByte) : at::empty({3, f.h, f.w}, at::kByte);
    std::memcpy(t.data_ptr(), f.data.data(), f.data.size());
    wick::Sample s{{key_, t}, {"label", at::scalar_tensor(it.label, at::kLong)}, {"index", at::scalar_tensor(j, at::kLong)}};
    if (video_) s["frame_times"] = at::tensor(f.times, at::kDouble);
    if (tokenizer_) {
      s["input_ids"] = at::tensor(it.ids, at::kLong);
      s["labels"] = at::tensor(it.labels, at::kLong);
      s["attention_mask"] = at::ones({static_cast<std::int64_t>(it.ids.size())}, at::kLong);
    }
    return s;
  }

  void note_skip(const std::string& path, const std::string& why) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (skipped_names_.insert(path).second) {
      ++skipped_;
      std::fprintf(stderr, "wick: %s: skipping %s\n", name_, why.c_str());
    }
  }

  std::uint64_t seed_;
  std::unique_ptr<wick::text::Tokenizer> tokenizer_;
  std::int64_t eos_ = -1, image_token_id_ = -1, text_length_ = 0;
  std::int64_t pad_multiple_ = 1;  // the token columns' length rounded up to a multiple of this, within text_length
  wick::media::Request req_;
  bool flip_ = false, fail_ = false, variable_size_ = false;
  std::vector<Item> items_;
  std::vector<std::string> classes_;
  mutable std::atomic<std::int64_t> epoch_{0};
  mutable std::atomic<std::uint64_t> run_seed_{0};
  mutable std::mutex mu_;
  mutable std::set<std::string> skipped_names_;
  mutable std::atomic<std::int64_t> skipped_{0};
  mutable std::atomic<std::int64_t> frames_decoded_{0}, frames_returned_{0}, seeks_{0};
};

}  // namespace

namespace wick::media {

std::shared_ptr<wick::Dataset> make_folder(const wick::Options& options, Kind kind) {
  return std::make_shared<MediaFolder>(options, kind);
}

wick::OptionSchema folder_options(Kind kind) {
  const bool video = kind == Kind::Video;
  wick::OptionSchema s = {
      wick::opt_string("root", wick::Value(), "a folder per class, files anywhere below it").optional(),
      wick::opt_string("manifest", wick::Value(), "CSV (header with path, label and/or text) or JSONL rows; paths relative to it").optional(),
      wick::opt("extensions", wick::OptionType::StringList,
                video ? wick::Value(wick::List{".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v"})
                       : wick::Value(wick::List{".jpg", ".jpeg", ".png", ".webp", ".bmp"}),
                "file extensions taken from root"),
      wick::opt_int("image_size", 112, "output height and width (shorter side with crop = 'none')").range(8, 8192),
      wick::opt_string("resize", "shorter_side", "shorter_side (keep the aspect), exact (stretch), letterbox (fit, pad black)")
          .one_of(wick::enum_names(kResizeNames)),
      wick::opt_string("crop", "center", "center, random_resized (area scale_min..scale_max, aspect 3/4..4/3) or none")
          .one_of(wick::enum_names(kCropNames)),
      wick::opt_number("scale_min", 0.08, "random_resized: smallest area fraction").range(0.01, 1),
      wick::opt_number("scale_max", 1.0, "random_resized: largest area fraction").range(0.01, 1),
      wick::opt_bool("flip", false, "mirror horizontally with probability 1/2"),
      wick::opt_int("decode_threads", 1, "decoder threads per file (the loader's workers decode files in parallel)").range(1, 64),
      wick::opt_string("on_error", "skip", "a file that cannot be decoded: skip (named once, counted, replaced) or fail")
          .one_of({"skip", "fail"}),
      wick::opt_number("time_limit", 30.0, "seconds one file may take to decode (0: no limit)").at_least(0),
      wick::opt_int("max_pixels", std::int64_t{8192} * 8192, "refuse frames larger than this many pixels before decoding").at_least(1),
      wick::opt_int("seed", 0, "seed for random frames, crops and flips (with the run's seed and the epoch)"),
      wick::opt_string("tokenizer", wick::Value(),
                       "text column as tokens: 'bytes' (UTF-8 bytes, end of text 256, image_token 257) or a Hugging "
                       "Face tokenizer.json (unset: no text)").optional(),
      wick::opt_int("text_length", 64, "tokens per sample at most (prompt + text + end of text; longer is cut)").at_least(2),
      wick::opt_int("pad_to_multiple_of", 1,
                    "a batch's tokens padded to its longest rounded up to a multiple of this (at most text_length): "
                    "fewer distinct sequence lengths, each of which cuDNN's attention plans anew on a GPU")
          .range(1, 65536),
      wick::opt_string("prompt", "", "text put before each sample's text, excluded from the labels (may hold image_token)"),
      wick::opt_string("image_token", "<image>", "the token standing for the picture's visual tokens ('' : none)"),
      wick::opt_string("eos_token", wick::Value(), "end-of-text token (default: <eos> for bytes; for a tokenizer.json the first of <|endoftext|>, </s>, <|end_of_text|> it holds)").optional(),
  };
  if (video) {
    s.push_back(wick::opt_int("max_frames", 16,
                              "frames per clip (T); 0: every stride-th frame of each clip (sampling = stride; at "
                              "most 4096), padded per batch with frame_mask saying which are real")
                    .range(0, wick::media::kMaxAllFrames));
    s.push_back(wick::opt_string("sampling", "uniform",
                                 "uniform (over the clip), random_segment (one random frame per equal segment), "
                                 "stride (every stride-th frame at fps)")
                    .one_of(wick::enum_names(kSamplingNames)));
    s.push_back(wick::opt_int("stride", 1, "stride: frames between samples").at_least(1));
    s.push_back(wick::opt_number("fps", 0.0, "stride: resample to this frame rate first (0: the clip's)").at_least(0));
    s.push_back(wick::opt_bool("random_start", false, "stride: start at a random time"));
    s.push_back(wick::opt_string("pad", "repeat", "a clip with fewer frames than wanted: repeat frames or loop the clip")
                    .one_of(wick::enum_names(kPadNames)));
  }
  return s;
}

}  // namespace wick::media
