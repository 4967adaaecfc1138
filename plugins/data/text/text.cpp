// data `text`: documents as token sequences for language models. Sources:
// plain text files (one document each) or JSONL lines with "text",
// pre-tokenized "input_ids", or "prompt" + "completion" (the prompt is masked
// out of the loss). Tokenizer: bytes (UTF-8 bytes 0-255, end of text 256),
// or byte-level BPE from a Hugging Face tokenizer.json.
// Truncation to max_length, or packing of documents into max_length chunks.
// Batches: input_ids [B, T] padded with end-of-text, labels [B, T] with -100
// on padding and prompts.

#include <wick/data.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "tokenizer.hpp"

namespace {

constexpr std::int64_t kIgnore = -100;

struct Doc {
  std::vector<std::int64_t> ids, labels;
};

class Text : public wick::Dataset {
 public:
  explicit Text(const wick::Options& o) : max_length_(o.get_int("max_length")) {
    const std::string tok = o.get_string("tokenizer");
    tokenizer_ = tok == "bytes" ? wick::text::byte_tokenizer() : wick::text::bpe_tokenizer(tok);
    const std::string eos = o.has("eos_token") ? o.get_string("eos_token") : tok == "bytes" ? "<eos>" : "<|endoftext|>";
    eos_ = tokenizer_->token_id(eos);
    if (eos_ < 0) throw wick::Error("data 'text': the tokenizer has no end-of-text token '" + eos + "' (set eos_token)");
    vocab_ = tokenizer_->vocab_size();
    std::vector<Doc> docs;
    if (o.has("files"))
      for (const auto& f : o.at("files").as_list()) docs.push_back(text_doc(read_file(f.as_string())));
    if (o.has("file")) read_jsonl(o.get_string("file"), docs);
    if (!o.has("files") && !o.has("file")) throw wick::Error("data 'text': give 'file' (JSONL) or 'files' (plain text)");
    if (o.get_bool("pack")) {
      Doc all;
      for (auto& d : docs) {
        all.ids.insert(all.ids.end(), d.ids.begin(), d.ids.end());
        all.labels.insert(all.labels.end(), d.labels.begin(), d.labels.end());
      }
      for (std::size_t i = 0; i < all.ids.size(); i += static_cast<std::size_t>(max_length_)) {
        const auto end = std::min(all.ids.size(), i + static_cast<std::size_t>(max_length_));
        if (end - i < 2) break;  // a chunk needs a target
        samples_.push_back({{all.ids.begin() + i, all.ids.begin() + end}, {all.labels.begin() + i, all.labels.begin() + end}});
      }
    } else {
      for (auto& d : docs) {
        if (static_cast<std::int64_t>(d.ids.size()) > max_length_) {
          d.ids.resize(max_length_);
          d.labels.resize(max_length_);
        }
        samples_.push_back(std::move(d));
      }
    }
    if (samples_.empty()) throw wick::Error("data 'text': the sources hold no text");
  }

  std::vector<std::int64_t> encode(const std::string& s) const override { return tokenizer_->encode(s); }
  std::string decode(const std::vector<std::int64_t>& ids) const override { return tokenizer_->decode(ids); }

  std::int64_t size() const override { return static_cast<std::int64_t>(samples_.size()); }

  wick::Sample get(std::int64_t i) const override {
    const auto& d = samples_.at(static_cast<std::size_t>(i));
    return {{"input_ids", at::tensor(d.ids, at::kLong)}, {"labels", at::tensor(d.labels, at::kLong)}};
  }

  // Pads to the longest sequence of the batch.
  wick::Batch collate(const std::vector<wick::Sample>& samples) const override {
    std::int64_t T = 0;
    for (const auto& s : samples) T = std::max(T, s.at("input_ids").size(0));
    const auto B = static_cast<std::int64_t>(samples.size());
    at::Tensor ids = at::full({B, T}, eos_, at::kLong), labels = at::full({B, T}, kIgnore, at::kLong);
    for (std::int64_t b = 0; b < B; ++b) {
      const auto& s = samples[static_cast<std::size_t>(b)];
      const auto n = s.at("input_ids").size(0);
      ids[b].narrow(0, 0, n).copy_(s.at("input_ids"));
      labels[b].narrow(0, 0, n).copy_(s.at("labels"));
    }
    return {{"input_ids", ids}, {"labels", labels}};
  }

  std::map<std::string, wick::Value> attributes() const override {
    std::int64_t tokens = 0;
    for (const auto& d : samples_) tokens += static_cast<std::int64_t>(d.ids.size());
    return {{"vocab_size", vocab_}, {"eos_id", eos_}, {"size", size()}, {"tokens", tokens}, {"max_length", max_length_}};
  }

 private:
  static std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw wick::Error("data 'text': cannot open " + path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  Doc text_doc(const std::string& text, const std::string& prompt = "") const {
    Doc d;
    d.ids = encode(prompt);
    d.labels.assign(d.ids.size(), kIgnore);
    for (auto id : encode(text)) {
      d.ids.push_back(id);
      d.labels.push_back(id);
    }
    d.ids.push_back(eos_);
    d.labels.push_back(eos_);
    return d;
  }

  void read_jsonl(const std::string& path, std::vector<Doc>& docs) const {
    std::ifstream in(path);
    if (!in) throw wick::Error("data 'text': cannot open " + path);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(n);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw wick::Error("data 'text': " + where + " is not valid JSON (" + e.what() + ")");
      }
      if (j.contains("input_ids")) {
        Doc d;
        for (const auto& x : j["input_ids"]) {
          if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() >= vocab_)
            throw wick::Error("data 'text': " + where + ": input_ids must be integers in [0, " +
                              std::to_string(vocab_) + ")");
          d.ids.push_back(x.get<std::int64_t>());
        }
        d.labels = d.ids;
        docs.push_back(std::move(d));
      } else if (j.contains("prompt") && j.contains("completion")) {
        docs.push_back(text_doc(j["completion"].get<std::string>(), j["prompt"].get<std::string>()));
      } else if (j.contains("text") && j["text"].is_string()) {
        docs.push_back(text_doc(j["text"].get<std::string>()));
      } else {
        throw wick::Error("data 'text': " + where + " has none of text, input_ids, or prompt and completion");
      }
    }
  }

  std::int64_t max_length_;
  std::unique_ptr<wick::text::Tokenizer> tokenizer_;
  std::int64_t eos_ = 0, vocab_ = 0;
  std::vector<Doc> samples_;
};

}  // namespace

WICK_PLUGIN(wick::data_plugin<Text>(
    "text", "text documents as tokens (bytes or BPE): plain files or JSONL (text, input_ids, prompt/completion), packing",
    {wick::opt("files", wick::OptionType::StringList, wick::Value(), "plain text files, one document each").optional(),
     wick::opt_string("file", wick::Value(), "JSONL: {\"text\"}, {\"input_ids\"} or {\"prompt\", \"completion\"}").optional(),
     wick::opt_int("max_length", 256, "tokens per sample (truncation, or the packed chunk length)").at_least(2),
     wick::opt_bool("pack", false, "concatenate documents and cut them into max_length chunks"),
     wick::opt_string("tokenizer", "bytes", "'bytes', or a Hugging Face tokenizer.json (byte-level BPE)"),
     wick::opt_string("eos_token", wick::Value(), "end-of-text token (default <eos> for bytes, <|endoftext|> for BPE)").optional()}))
