// data `text`: documents as token sequences for language models. Sources:
// plain text files (one document each) or JSONL lines with "text",
// pre-tokenized "input_ids" (with optional "labels", -100 where a token does
// not count), or "prompt" + "completion" (the prompt is masked out of the loss),
// or TRL's conversational rows rendered through the tokenizer folder's chat
// template (chat.hpp): "messages" (the loss on the assistant's turns) and
// "prompt" + "completion" as lists of messages. Tokenizer: bytes (UTF-8
// bytes 0-255, end of text 256), or BPE from a Hugging Face tokenizer.json
// (or a folder holding one). With no sources at all the data set is the
// tokenizer alone (wick.tokenizer): encode, decode, apply_chat_template.
// Truncation to max_length, or packing of documents into max_length chunks.
// Batches: input_ids [B, T] padded with end-of-text, labels [B, T] with -100
// on padding and prompts.
// A document with nothing to learn from (one token, so no next token to
// predict, or every label masked) is skipped: named on stderr with its file
// (and JSONL line), counted in the `skipped_items` attribute; only a source
// with nothing left at all is an error.

#include <wick/data.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <wick/kit/crc32c.hpp>
#include <wick/kit/safetensors.hpp>

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <mutex>
#include <optional>

#include "lib/chat/chat.hpp"
#include "lib/tokenizer/jsonl.hpp"
#include "lib/tokenizer/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kIgnore = -100;

struct Doc {
  std::vector<std::int64_t> ids, labels;
  std::vector<std::int64_t> pos;      // pack_attention = "document": each token's position in its document
  std::int64_t source = 0, line = 0;  // index into the sources; JSONL line (0: a plain file)
};

// Why a sample teaches nothing (a causal model predicts token t+1 from the
// tokens up to t: labels from the second on count), or "" when it teaches.
std::string nothing_to_learn(const Doc& d) {
  if (d.ids.size() < 2)
    return std::to_string(d.ids.size()) + " token" + (d.ids.size() == 1 ? "" : "s") +
           ", and a sample needs 2 (a token and the next one to predict)";
  for (std::size_t t = 1; t < d.labels.size(); ++t)
    if (d.labels[t] != kIgnore) return "";
  return "every label after the first token is masked (a prompt without a completion, or one that fills max_length)";
}

// A source file: JSONL (one document a line) or plain text (one document).
struct Source {
  std::string path;
  bool jsonl = false;
};

bool is_pattern(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// `key`'s list (files, eval_files): each entry a file, or a shell pattern
// (*, ?, [...]) whose matches are taken in sorted order; a pattern that
// matches no file, a missing file and a folder are errors naming the entry.
// A file whose name ends in .jsonl is JSONL, any other plain text.
std::vector<Source> expand(const wick::List& entries, const std::string& key) {
  std::vector<Source> out;
  for (std::size_t n = 0; n < entries.size(); ++n) {
    const std::string entry = entries[n].as_string();
    const std::string where = "data 'text': " + key + "[" + std::to_string(n + 1) + "] '" + entry + "'";
    std::vector<std::string> matches;
    std::error_code exists_ec;
    if (is_pattern(entry) && !fs::is_regular_file(entry, exists_ec)) {  // a file so named is itself
      glob_t g{};
      const int rc = ::glob(entry.c_str(), GLOB_NOSORT, nullptr, &g);
      for (std::size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) matches.emplace_back(g.gl_pathv[i]);
      globfree(&g);
      if (rc == GLOB_NOSPACE || rc == GLOB_ABORTED)
        throw wick::Error(where + ": the pattern could not be expanded (a folder on its way cannot be read)");
      std::sort(matches.begin(), matches.end());  // bytewise, whatever the locale
      std::error_code ec;
      std::erase_if(matches, [&](const std::string& m) { return fs::is_directory(m, ec); });
      if (matches.empty())
        throw wick::Error(where + " matches no file, expected a pattern (*, ?, [...]) that names at least one file");
    } else {
      std::error_code ec;
      if (fs::is_directory(entry, ec))
        throw wick::Error(where + " is a folder, expected a file or a pattern such as '" +
                          (fs::path(entry) / "*.jsonl").string() + "'");
      if (!fs::exists(entry, ec)) throw wick::Error(where + ": no such file, expected a text or JSONL file or a pattern");
      matches.push_back(entry);
    }
    for (auto& m : matches) {
      const bool jsonl = fs::path(m).extension() == ".jsonl";
      out.push_back({std::move(m), jsonl});
    }
  }
  return out;
}

// The same file however it is named (relative, through links).
std::string same_file_key(const std::string& path) {
  std::error_code ec;
  const auto c = fs::weakly_canonical(path, ec);
  return ec ? path : c.string();
}

// The held-out documents (eval: true) or the rest: ceil(fraction * n) of
// them (at least one), drawn by `seed` (a Fisher-Yates shuffle over
// splitmix64, the same on every platform), each half in the sources' order.
// Documents, not chunks: a document is never in both halves.
std::vector<Doc> split_documents(std::vector<Doc> docs, double fraction, std::int64_t seed, bool eval) {
  const std::size_t n = docs.size();
  const auto k = static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(n) - 1e-9));
  const std::size_t held = std::max<std::size_t>(k, 1);
  if (held >= n)
    throw wick::Error("data 'text': eval_fraction " + wick::Value(fraction).repr() + " holds out " + std::to_string(held) +
                      " of the " + std::to_string(n) + " document" + (n == 1 ? "" : "s") +
                      ", leaving none to train on; expected a smaller fraction or more documents");
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::uint64_t state = static_cast<std::uint64_t>(seed) ^ 0x5745494b53504c54ULL;  // "WEIKSPLT"
  auto next = [&] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  for (std::size_t i = n - 1; i > 0; --i) std::swap(order[i], order[next() % (i + 1)]);
  std::vector<bool> in_eval(n, false);
  for (std::size_t i = 0; i < held; ++i) in_eval[order[i]] = true;
  std::vector<Doc> out;
  for (std::size_t i = 0; i < n; ++i)
    if (in_eval[i] == eval) out.push_back(std::move(docs[i]));
  return out;
}

class Text : public wick::Dataset {
 public:
  explicit Text(const wick::Options& o)
      : max_length_(o.get_int("max_length")),
        pad_multiple_(o.get_int("pad_to_multiple_of")),
        assistant_only_loss_(o.get_bool("assistant_only_loss")),
        completion_only_loss_(o.get_bool("completion_only_loss")) {
    const std::string tok = tokenizer_file(o.get_string("tokenizer"));
    const std::string eos = read_tokenizer(o, tok);
    if (!o.has("files") && !o.has("file")) {  // the tokenizer alone (wick.tokenizer)
      check_tokenizer_alone(o);
      return;
    }
    check_source_options(o);
    // the sources: `files` (each a file or a glob pattern, expanded sorted;
    // a file named *.jsonl is JSONL, any other plain text, one document) and
    // `file` (JSONL); the held-out half (split = "eval") reads eval_files
    // instead, and the training half leaves them out
    const std::string split = o.get_string("split");
    const double fraction = o.get_number("eval_fraction");
    const std::vector<Source> sources = select_sources(o, split);
    std::vector<std::string> paths;
    for (const auto& src : sources) paths.push_back(src.path);
    std::vector<Doc> docs = read_documents(o, sources, paths, tok, eos);
    if (fraction > 0) docs = split_documents(std::move(docs), fraction, o.get_int("split_seed"), split == "eval");
    documents_ = static_cast<std::int64_t>(docs.size());
    std::string first_skip;
    if (o.get_bool("pack")) {
      pack_samples(docs, first_skip);
    } else {
      truncate_samples(docs, paths, first_skip);
    }
    check_samples(first_skip);
  }

 private:
  // The tokenizer (its folder kept for the chat template) and its
  // end-of-text token; the token's text.
  std::string read_tokenizer(const wick::Options& o, const std::string& tok) {
    if (tok != "bytes") folder_ = fs::path(tok).parent_path().string();
    if (folder_.empty() && tok != "bytes") folder_ = ".";
    tokenizer_ = tok == "bytes" ? wick::text::byte_tokenizer() : wick::text::bpe_tokenizer(tok);
    std::string eos = o.has("eos_token") ? o.get_string("eos_token") : wick::text::default_eos(*tokenizer_);
    // a chat model's folder whose tokenizer holds none of those: its tokenizer_config.json's eos_token
    if (!o.has("eos_token") && tokenizer_->token_id(eos) < 0 && !folder_.empty())
      if (auto t = wick::text::config_token(folder_, "eos_token"); !t.empty() && tokenizer_->token_id(t) >= 0) eos = t;
    eos_ = tokenizer_->token_id(eos);
    // the tokenizer alone (no sources) needs none: it pads no batch
    if (eos_ < 0 && (o.has("files") || o.has("file")))
      throw wick::Error("data 'text': the tokenizer has no end-of-text token '" + eos + "' (set eos_token)");
    vocab_ = tokenizer_->vocab_size();
    return eos;
  }

  static void check_tokenizer_alone(const wick::Options& o) {
    for (const char* k : {"eval_files", "eval_fraction", "pack_attention"})
      if (o.has(k) && !(std::string(k) == "eval_fraction" && o.get_number(k) == 0))
        throw wick::Error(std::string("data 'text': ") + k + " is given without files or file, expected the sources it applies to");
  }

  // pack_attention and the held-out documents' options, and how they meet.
  void check_source_options(const wick::Options& o) {
    pack_document_ = o.has("pack_attention") && o.get_string("pack_attention") == "document";
    if (o.has("pack_attention") && !o.get_bool("pack"))
      throw wick::Error("data 'text': pack_attention = '" + o.get_string("pack_attention") +
                        "' without pack = true, expected pack = true (it says how packed documents attend)");
    const std::string split = o.get_string("split");
    const double fraction = o.get_number("eval_fraction");
    if (fraction >= 1)
      throw wick::Error("data 'text': eval_fraction " + wick::Value(fraction).repr() +
                        " leaves no document to train on, expected a fraction in [0, 1)");
    if (fraction > 0 && o.has("eval_files"))
      throw wick::Error("data 'text': eval_fraction and eval_files are both given, expected one way to hold out the "
                        "evaluation documents");
    if (split == "eval" && fraction == 0 && !o.has("eval_files"))
      throw wick::Error("data 'text': split = 'eval' without eval_fraction or eval_files, expected one of them to say "
                        "which documents are held out");
  }

  static std::vector<Source> select_sources(const wick::Options& o, const std::string& split) {
    std::vector<Source> sources;
    if (o.has("files")) sources = expand(o.at("files").as_list(), "files");
    if (o.has("file")) sources.push_back({o.get_string("file"), true});
    if (!o.has("eval_files")) return sources;
    auto held = expand(o.at("eval_files").as_list(), "eval_files");
    if (split == "eval") return held;
    // the training half: every source but the held-out files
    std::vector<std::string> out;
    for (const auto& h : held) out.push_back(same_file_key(h.path));
    std::erase_if(sources, [&](const Source& s) {
      return std::find(out.begin(), out.end(), same_file_key(s.path)) != out.end();
    });
    if (sources.empty())
      throw wick::Error("data 'text': every file is among eval_files, expected files to train on beside them");
    return sources;
  }

  // Tokenized documents are cached on disk, keyed by the sources (path,
  // size, modification time), the tokenizer and the end-of-text token: a
  // second run reads them instead of tokenizing again.
  std::vector<Doc> read_documents(const wick::Options& o, const std::vector<Source>& sources,
                                  const std::vector<std::string>& paths, const std::string& tok, const std::string& eos) {
    const fs::path cache = cache_file(o, paths, tok, eos);
    std::vector<Doc> docs;
    if (!cache.empty() && read_cache(cache, docs)) {
      cached_ = true;
      return docs;
    }
    for (std::size_t k = 0; k < sources.size(); ++k) {
      const auto& src = sources[k];
      if (src.jsonl) {
        read_jsonl(src.path, static_cast<std::int64_t>(k), docs);
      } else {
        docs.push_back(text_doc(read_file(src.path), "", src.path));
        docs.back().source = static_cast<std::int64_t>(k);
      }
    }
    if (!cache.empty()) write_cache(cache, docs);
    return docs;
  }

  // A sample with nothing to learn from, told of (the first ten) and counted.
  void skip(const std::string& what, const std::string& why, std::string& first_skip) {
    if (skipped_ < 10) std::fprintf(stderr, "wick: data 'text': skipping %s: %s\n", what.c_str(), why.c_str());
    if (first_skip.empty()) first_skip = what + ": " + why;
    ++skipped_;
  }

  // pack = true: the documents end to end, cut into max_length chunks.
  // pack_attention = "document": each token's position within its
  // document (restarting at 0 at each document's first token, and at
  // each chunk's first), from which the model masks attention across
  // documents; a document's first token is not predicted from the one
  // before it, which belongs to another document
  void pack_samples(const std::vector<Doc>& docs, std::string& first_skip) {
    Doc all;
    for (auto& d : docs) {
      all.ids.insert(all.ids.end(), d.ids.begin(), d.ids.end());
      all.labels.insert(all.labels.end(), d.labels.begin(), d.labels.end());
      if (pack_document_) {
        for (std::size_t t = 0; t < d.ids.size(); ++t) all.pos.push_back(static_cast<std::int64_t>(t));
        if (!d.ids.empty()) all.labels[all.labels.size() - d.ids.size()] = kIgnore;
      }
    }
    for (std::size_t i = 0; i < all.ids.size(); i += static_cast<std::size_t>(max_length_)) {
      const auto end = std::min(all.ids.size(), i + static_cast<std::size_t>(max_length_));
      if (end - i < 2) break;  // a chunk needs a target
      Doc chunk{{all.ids.begin() + i, all.ids.begin() + end}, {all.labels.begin() + i, all.labels.begin() + end}};
      if (pack_document_) {  // a document cut by the chunk's start begins anew: it sees nothing before
        chunk.pos.assign(all.pos.begin() + i, all.pos.begin() + end);
        for (std::size_t t = 0; t < chunk.pos.size() && chunk.pos[t] != 0; ++t) chunk.pos[t] = static_cast<std::int64_t>(t);
      }
      if (const auto why = nothing_to_learn(chunk); !why.empty()) {
        skip("packed chunk " + std::to_string(i / static_cast<std::size_t>(max_length_) + 1) + " (tokens " +
                 std::to_string(i) + " to " + std::to_string(end - 1) + ")",
             why, first_skip);
        continue;
      }
      samples_.push_back(std::move(chunk));
    }
  }

  // pack = false: a sample a document, cut to max_length.
  void truncate_samples(std::vector<Doc>& docs, const std::vector<std::string>& paths, std::string& first_skip) {
    auto where = [&](const Doc& d) {
      const auto i = static_cast<std::size_t>(d.source);
      const std::string src = i < paths.size() ? paths[i] : "?";
      return d.line > 0 ? src + ":" + std::to_string(d.line) : src;
    };
    for (auto& d : docs) {
      if (static_cast<std::int64_t>(d.ids.size()) > max_length_) {
        d.ids.resize(max_length_);
        d.labels.resize(max_length_);
      }
      if (const auto why = nothing_to_learn(d); !why.empty()) {
        skip(where(d), why, first_skip);
        continue;
      }
      samples_.push_back(std::move(d));
    }
  }

  void check_samples(const std::string& first_skip) const {
    if (skipped_ > 10)
      std::fprintf(stderr, "wick: data 'text': skipping %lld more with nothing to learn from (%lld in all)\n",
                   static_cast<long long>(skipped_ - 10), static_cast<long long>(skipped_));
    if (samples_.empty() && skipped_ > 0)
      throw wick::Error("data 'text': no sample has anything to learn from (" + std::to_string(skipped_) +
                        " skipped; the first: " + first_skip + ")");
    if (samples_.empty()) throw wick::Error("data 'text': the sources hold no text");
  }

 public:

  using wick::Dataset::decode, wick::Dataset::encode;
  std::vector<std::int64_t> encode(const std::string& s, bool add_special_tokens) const override {
    return tokenizer_->encode(s, add_special_tokens);
  }
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const override {
    return tokenizer_->decode(ids, skip_special_tokens);
  }

  std::string apply_chat_template(const std::string& messages_json, const std::string& options_json) const override {
    const std::string where = "apply_chat_template";
    auto parse = [&](const std::string& text, const char* what) {
      try {
        return nlohmann::ordered_json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        throw wick::Error(where + ": the " + what + " are not valid JSON: " + wick::json_error_text(e));
      }
    };
    const auto messages = parse(messages_json, "messages");
    auto options = parse(options_json, "options");
    if (!options.is_object()) throw wick::Error(where + ": the options are not a table of names");
    bool add_generation_prompt = false;
    if (options.contains("add_generation_prompt")) {
      const auto& g = options["add_generation_prompt"];
      if (!g.is_boolean())
        throw wick::Error(where + ": add_generation_prompt is " + wick::json_brief(nlohmann::json(g)) + ", expected true or false");
      add_generation_prompt = g.get<bool>();
      options.erase("add_generation_prompt");
    }
    // transformers' continue_final_message (true, or the field's name): the render ends inside the final message
    std::string field;
    if (options.contains("continue_final_message")) {
      const auto& c = options["continue_final_message"];
      if (c.is_boolean()) field = c.get<bool>() ? "content" : "";
      else if (c.is_string() && !c.get<std::string>().empty()) field = c.get<std::string>();
      else throw wick::Error(where + ": continue_final_message is " + wick::json_brief(nlohmann::json(c)) +
                             ", expected true or false, or the name of the final message's field to continue");
      options.erase("continue_final_message");
    }
    for (const char* k : {"return_dict", "return_assistant_tokens_mask"})
      if (options.contains(k))
        throw wick::Error(where + ": option '" + k + "' is wick.tokenizer's (a data set's apply_chat_template gives "
                          "the text or its ids), expected wick.tokenizer(folder):apply_chat_template");
    if (!field.empty() && add_generation_prompt)
      throw wick::Error(where + ": continue_final_message and add_generation_prompt are both set, expected one: "
                        "continue_final_message continues the final message, add_generation_prompt starts a new "
                        "assistant message");
    wick::text::check_messages(messages, where, "messages");
    const auto& format = chat(where);
    if (field.empty()) return format.render(messages, add_generation_prompt, where, options).text;
    auto tagged = messages;
    const std::string final_text = wick::text::tag_final_message(tagged, field, format.source(), where);
    return wick::text::continued_text(format.render(tagged, false, where, options).text, final_text, field, where,
                                      format.file());
  }

  std::int64_t size() const override { return static_cast<std::int64_t>(samples_.size()); }

  wick::Sample get(std::int64_t i) const override {
    const auto& d = samples_.at(static_cast<std::size_t>(i));
    wick::Sample s{{"input_ids", at::tensor(d.ids, at::kLong)}, {"labels", at::tensor(d.labels, at::kLong)}};
    if (pack_document_) s["position_ids"] = at::tensor(d.pos, at::kLong);
    return s;
  }

  // Pads to the longest sequence of the batch, rounded up to a multiple of
  // pad_to_multiple_of where max_length leaves room: fewer distinct shapes
  // (cuDNN's attention plans one per sequence length on a GPU). The padding
  // follows every real token, so a causal model's outputs at real positions,
  // and the loss, are those of the unpadded batch.
  wick::Batch collate(const std::vector<wick::Sample>& samples) const override {
    std::int64_t T = 0;
    for (const auto& s : samples) T = std::max(T, s.at("input_ids").size(0));
    T = std::max(T, std::min((T + pad_multiple_ - 1) / pad_multiple_ * pad_multiple_, max_length_));
    const auto B = static_cast<std::int64_t>(samples.size());
    at::Tensor ids = at::full({B, T}, eos_, at::kLong), labels = at::full({B, T}, kIgnore, at::kLong);
    // position_ids: the padding continues the row's last document (after
    // its tokens, which it cannot change: attention is causal; its labels are ignored)
    at::Tensor pos = pack_document_ ? at::empty({B, T}, at::kLong) : at::Tensor();
    for (std::int64_t b = 0; b < B; ++b) {
      const auto& s = samples[static_cast<std::size_t>(b)];
      const auto n = s.at("input_ids").size(0);
      ids[b].narrow(0, 0, n).copy_(s.at("input_ids"));
      labels[b].narrow(0, 0, n).copy_(s.at("labels"));
      if (pos.defined()) {
        const at::Tensor p = s.at("position_ids");
        pos[b].narrow(0, 0, n).copy_(p);
        const std::int64_t next = n > 0 ? p[n - 1].item<std::int64_t>() + 1 : 0;
        if (T > n) pos[b].narrow(0, n, T - n).copy_(at::arange(next, next + T - n, at::kLong));
      }
    }
    if (pos.defined()) return {{"input_ids", ids}, {"labels", labels}, {"position_ids", pos}};
    return {{"input_ids", ids}, {"labels", labels}};
  }

  std::map<std::string, wick::Value> attributes() const override {
    std::int64_t tokens = 0;
    for (const auto& d : samples_) tokens += static_cast<std::int64_t>(d.ids.size());
    return {{"vocab_size", vocab_}, {"eos_id", eos_}, {"size", size()}, {"tokens", tokens}, {"max_length", max_length_},
            {"cached", cached_}, {"cache_file", cache_path_}, {"skipped_items", skipped_},
            {"documents", documents_}};  // this split's documents, before packing or skipping
  }

 private:
  static std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw wick::Error("data 'text': cannot open " + path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // The document's tokens; the tokenizer's errors name it (`where`: its file, and JSONL line).
  Doc text_doc(const std::string& text, const std::string& prompt, const std::string& where) const {
    Doc d;
    try {
      d.ids = encode(prompt);
      if (completion_only_loss_) d.labels.assign(d.ids.size(), kIgnore);
      else d.labels = d.ids;
      for (auto id : tokenizer_->encode(text, /*add_special_tokens=*/false)) {  // the template's BOS came with the prompt
        d.ids.push_back(id);
        d.labels.push_back(id);
      }
    } catch (const wick::Error& e) {
      throw wick::Error("data 'text': " + where + ": " + e.what());
    }
    d.ids.push_back(eos_);
    d.labels.push_back(eos_);
    return d;
  }

  // The tokenizer folder's chat template, read when a conversation first
  // needs it; `who` (what needs it) begins the error when there is none.
  const wick::text::ChatFormat& chat(const std::string& who) const {
    std::lock_guard<std::mutex> lock(chat_mu_);
    if (!chat_) {
      if (folder_.empty())
        throw wick::Error(who + " needs a chat template, and the tokenizer is 'bytes': expected tokenizer = a Hugging "
                                "Face model folder (its tokenizer.json and chat template) or its tokenizer.json");
      chat_.emplace(folder_);
    }
    if (!chat_->has_template()) chat_->missing(who);
    return *chat_;
  }

  // The tokenizer option as a file: "bytes", a tokenizer.json, or a folder holding one.
  static std::string tokenizer_file(const std::string& given) {
    std::error_code ec;
    // a path named as a JSON file is read as one (a folder there is said to be no JSON file)
    if (given == "bytes" || given.ends_with(".json") || !fs::is_directory(given, ec)) return given;
    const fs::path f = fs::path(given) / "tokenizer.json";
    if (!fs::exists(f, ec))
      throw wick::Error("data 'text': tokenizer " + given + " is a folder without a tokenizer.json, expected 'bytes', "
                        "a tokenizer.json, or a folder holding one");
    return f.string();
  }

  void read_jsonl(const std::string& path, std::int64_t source, std::vector<Doc>& docs) const {
    std::error_code ec;
    if (fs::is_directory(path, ec)) throw wick::Error("data 'text': file " + path + " is a directory, expected a JSONL file");
    std::ifstream in(path);
    if (!in) throw wick::Error("data 'text': cannot open " + path);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      const std::size_t before = docs.size();
      const std::string where = path + ":" + std::to_string(n);
      auto r = wick::text::parse_jsonl_line(line, where, vocab_);
      if (r.kind == wick::text::JsonlRecord::Ids) {
        Doc d;
        d.ids = std::move(r.ids);
        d.labels = r.labels.empty() ? d.ids : std::move(r.labels);
        docs.push_back(std::move(d));
      } else if (r.kind == wick::text::JsonlRecord::PromptCompletion) {
        docs.push_back(text_doc(r.text, r.prompt, where));
      } else if (r.kind == wick::text::JsonlRecord::Text) {
        docs.push_back(text_doc(r.text, "", where));
      } else if (r.kind == wick::text::JsonlRecord::Messages || r.kind == wick::text::JsonlRecord::ChatPromptCompletion) {
        const std::string who = "data 'text': " + where;
        const auto& format = chat(who + ": a conversation");
        const auto t = r.kind == wick::text::JsonlRecord::Messages
                           ? wick::text::messages_tokens(format, *tokenizer_, r.messages, assistant_only_loss_, who, r.extra)
                           : wick::text::prompt_completion_tokens(format, *tokenizer_, r.messages, r.completion,
                                                                  completion_only_loss_, who, r.extra);
        if (t.prompt_not_prefix && !prompt_note_++)
          std::fprintf(stderr, "wick: note: data 'text': %s: the prompt's tokens do not begin the prompt and completion's "
                       "(the template renders the prompt otherwise when a completion follows); as many tokens are "
                       "masked all the same, as TRL does\n", where.c_str());
        docs.push_back(Doc{t.ids, t.labels});  // the template ends each turn: no end-of-text added
      }
      for (std::size_t k = before; k < docs.size(); ++k) {
        docs[k].source = source;
        docs[k].line = n;
      }
    }
  }

  fs::path cache_file(const wick::Options& o, const std::vector<std::string>& sources, const std::string& tok,
                      const std::string& eos) {
    std::string dir = o.get_string("cache_dir");
    if (dir == "none") return {};
    if (!dir.empty()) {
      // a folder asked for by name: one that cannot be one would leave every
      // run uncached without a word (a cache the default place cannot hold is
      // only slower)
      std::error_code ec;
      const bool is_dir = fs::is_directory(dir, ec);
      if (!is_dir && fs::exists(fs::symlink_status(dir, ec)))
        throw wick::Error("data 'text': cache_dir " + dir + " is " +
                          (fs::is_symlink(fs::symlink_status(dir, ec)) && !fs::exists(dir, ec) ? "a broken link"
                                                                                               : "not a folder") +
                          ", expected a folder for the token cache (or 'none': no cache)");
      if (!is_dir && (fs::create_directories(dir, ec), ec))
        throw wick::Error("data 'text': cache_dir " + dir + " cannot be made: " + ec.message() +
                          ", expected a folder for the token cache (or 'none': no cache)");
    }
    if (dir.empty()) {
      const char* c = std::getenv("WICK_CACHE_DIR");
      const char* x = std::getenv("XDG_CACHE_HOME");
      const char* h = std::getenv("HOME");
      dir = c && *c ? std::string(c) : x && *x ? std::string(x) + "/wick" : h && *h ? std::string(h) + "/.cache/wick" : "";
      if (dir.empty()) return {};
      dir += "/tokens";
    }
    std::string key = "wick text tokens v7\n" + tok + "\n" + eos + "\n" + (assistant_only_loss_ ? "a" : "-") +
                      (completion_only_loss_ ? "c" : "-") + "\n";
    auto stamp = [&](const std::string& path) {
      std::error_code ec;
      const auto abs = fs::absolute(path, ec);
      const auto size = fs::file_size(path, ec);
      const auto mtime = fs::last_write_time(path, ec).time_since_epoch().count();
      key += abs.string() + " " + std::to_string(ec ? 0 : size) + " " + std::to_string(mtime) + "\n";
    };
    if (tok != "bytes") {
      stamp(tok);
      for (const char* f : {"tokenizer_config.json", "chat_template.jinja"})  // the chat template and its tokens
        if (std::error_code ec; fs::exists(fs::path(folder_) / f, ec)) stamp((fs::path(folder_) / f).string());
    }
    for (const auto& src : sources) stamp(src);
    std::uint64_t h = 1469598103934665603ULL;  // FNV-1a 64
    for (unsigned char ch : key) h = (h ^ ch) * 1099511628211ULL;
    char name[40];
    std::snprintf(name, sizeof name, "%016llx.safetensors", static_cast<unsigned long long>(h));
    cache_path_ = (fs::path(dir) / name).string();
    return cache_path_;
  }

  // The tensors of a cache file, in the order their CRC-32C runs over them.
  static constexpr const char* kCacheTensors[] = {"ids", "labels", "offsets", "source", "line"};

  // The documents of a cache file. One that cannot be used (unreadable,
  // inconsistent, or with bytes that no longer match its checksum) is
  // named on stderr, and the sources are tokenized again and the file
  // rewritten: a damaged cache is never trained on.
  static bool read_cache(const fs::path& file, std::vector<Doc>& docs) {
    std::error_code ec;
    if (!fs::exists(file, ec)) return false;
    std::string why;
    try {
      why = read_cache_tensors(file, docs);
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty()) return true;
    docs.clear();
    std::fprintf(stderr, "wick: data 'text': the token cache %s is damaged (%s): tokenizing the sources again\n",
                 file.c_str(), why.c_str());
    return false;
  }

  // "" when `docs` was read, else what is wrong with the file.
  static std::string read_cache_tensors(const fs::path& file, std::vector<Doc>& docs) {
    auto f = wick::read_safetensors(file);
    std::uint32_t crc = 0;
    for (const char* name : kCacheTensors) {
      const at::Tensor* t = f.get(name);
      if (!t) return std::string("no tensor ") + name;
      if (t->scalar_type() != at::kLong || t->dim() != 1) return std::string("tensor ") + name + " is not a list of int64";
      crc = wick::crc32c(t->data_ptr(), static_cast<std::size_t>(t->numel()) * sizeof(std::int64_t), crc);
    }
    const auto stored = f.metadata.find("crc32c");
    if (stored == f.metadata.end()) return "no crc32c in its metadata";
    if (stored->second != crc_hex(crc)) return "its CRC-32C is " + crc_hex(crc) + ", its metadata says " + stored->second;
    const at::Tensor *ids = f.get("ids"), *labels = f.get("labels"), *offsets = f.get("offsets");
    const at::Tensor *source = f.get("source"), *line = f.get("line");
    if (source->numel() + 1 != offsets->numel() || line->numel() + 1 != offsets->numel()) return "offsets, source and line disagree";
    const auto* pi = ids->data_ptr<std::int64_t>();
    const auto* pl = labels->data_ptr<std::int64_t>();
    const auto* po = offsets->data_ptr<std::int64_t>();
    // never read past its end
    if (ids->numel() != labels->numel() || offsets->numel() < 1 || po[0] != 0 || po[offsets->numel() - 1] != ids->numel())
      return "its offsets do not span its ids";
    for (std::int64_t d = 0; d + 1 < offsets->numel(); ++d)
      if (po[d + 1] < po[d]) return "its offsets decrease";
    for (std::int64_t d = 0; d + 1 < offsets->numel(); ++d) {
      Doc doc;
      doc.ids.assign(pi + po[d], pi + po[d + 1]);
      doc.labels.assign(pl + po[d], pl + po[d + 1]);
      doc.source = source->data_ptr<std::int64_t>()[d];
      doc.line = line->data_ptr<std::int64_t>()[d];
      docs.push_back(std::move(doc));
    }
    return "";
  }

  static std::string crc_hex(std::uint32_t crc) {
    char s[16];
    std::snprintf(s, sizeof s, "%08x", crc);
    return s;
  }

  // Written through a temporary file renamed over the old one
  // (write_safetensors), with the CRC-32C of its tensors in the metadata.
  static void write_cache(const fs::path& file, const std::vector<Doc>& docs) {
    std::vector<std::int64_t> ids, labels, offsets{0}, source, line;
    for (const auto& d : docs) {
      ids.insert(ids.end(), d.ids.begin(), d.ids.end());
      labels.insert(labels.end(), d.labels.begin(), d.labels.end());
      offsets.push_back(static_cast<std::int64_t>(ids.size()));
      source.push_back(d.source);
      line.push_back(d.line);
    }
    std::uint32_t crc = 0;
    for (const auto* v : {&ids, &labels, &offsets, &source, &line})  // kCacheTensors' order
      crc = wick::crc32c(v->data(), v->size() * sizeof(std::int64_t), crc);
    try {
      fs::create_directories(file.parent_path());
      wick::write_safetensors(file, {{"ids", at::tensor(ids, at::kLong)}, {"labels", at::tensor(labels, at::kLong)},
                                     {"offsets", at::tensor(offsets, at::kLong)},
                                     {"source", at::tensor(source, at::kLong)}, {"line", at::tensor(line, at::kLong)}},
                              {{"crc32c", crc_hex(crc)}});
    } catch (const std::exception&) {
      // a cache that cannot be written is only slower next time
    }
  }

  bool cached_ = false;
  bool pack_document_ = false;  // pack_attention = "document": samples carry position_ids
  std::int64_t documents_ = 0;
  std::int64_t skipped_ = 0;
  std::string cache_path_;
  std::int64_t max_length_;
  std::int64_t pad_multiple_ = 1;  // a batch's length rounded up to a multiple of this, within max_length
  bool assistant_only_loss_, completion_only_loss_;
  std::string folder_;  // the tokenizer's folder: its chat template ("" for bytes)
  mutable std::mutex chat_mu_;
  mutable std::optional<wick::text::ChatFormat> chat_;
  mutable std::int64_t prompt_note_ = 0;  // rows whose prompt tokens are no prefix: named once
  std::unique_ptr<wick::text::Tokenizer> tokenizer_;
  std::int64_t eos_ = 0, vocab_ = 0;
  std::vector<Doc> samples_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Text>(
    "text", "text documents as tokens (bytes or BPE): plain files or JSONL (text, input_ids, prompt/completion, chat messages "
    "through the folder's template), packing",
    {wick::opt("files", wick::OptionType::StringList, wick::Value(),
               "files or shell patterns (*, ?, [...]) expanded sorted, a pattern matching nothing an error: a *.jsonl "
               "file is read as JSONL (as `file`), any other as plain text, one document").optional(),
     wick::opt_string("file", wick::Value(), "JSONL: {\"text\"}, {\"input_ids\"[, \"labels\"]}, {\"prompt\", \"completion\"} (strings or lists of messages) or {\"messages\"}").optional(),
     wick::opt_int("max_length", 256, "tokens per sample (truncation, or the packed chunk length)").at_least(2),
     wick::opt_bool("pack", false, "concatenate documents and cut them into max_length chunks"),
     wick::opt_int("pad_to_multiple_of", 1,
                   "a batch padded to its longest sample rounded up to a multiple of this (at most max_length): "
                   "fewer distinct sequence lengths, each of which cuDNN's attention plans anew on a GPU")
         .range(1, 65536),
     wick::opt_string("pack_attention", wick::Value(),
                      "with pack: 'row' (default: a packed chunk's documents see those before them) or 'document' "
                      "(samples carry position_ids restarting at each document, and the model attends within each "
                      "document only, as flash-attention's varlen packing; a document's first token is not a target)")
         .one_of({"row", "document"})
         .optional(),
     wick::opt("eval_files", wick::OptionType::StringList, wick::Value(),
               "held-out files or patterns (as files): split = 'eval' reads them, 'train' leaves them out of files").optional(),
     wick::opt_number("eval_fraction", 0.0,
                     "hold out this fraction of the documents (ceil, at least one when > 0; documents, never chunks), "
                     "drawn by split_seed; below 1, and leaving at least one to train on")
         .range(0, 1),
     wick::opt_string("split", "train",
                      "with eval_fraction or eval_files: 'train' holds the rest, 'eval' the held-out documents (make the "
                      "data set twice, once each, for wick.train's data and eval_data)")
         .one_of({"train", "eval"}),
     wick::opt_int("split_seed", 0, "the seed of eval_fraction's draw (the same documents on every run and platform)"),
     wick::opt_string("tokenizer", "bytes", "'bytes', a Hugging Face tokenizer.json, or a model folder holding one (and its chat template)"),
     wick::opt_bool("assistant_only_loss", true, "messages rows: the loss on the assistant's turns only ({% generation %} spans, else each rendered assistant turn)"),
     wick::opt_bool("completion_only_loss", true, "prompt/completion rows: the loss on the completion only"),
     wick::opt_string("eos_token", wick::Value(), "end-of-text token (default: <eos> for bytes; for a tokenizer.json the first of <|endoftext|>, </s>, <|end_of_text|> it holds)").optional(),
     wick::opt_string("cache_dir", "", "where tokenized documents are cached ('': $WICK_CACHE_DIR or ~/.cache/wick/tokens; 'none': no cache)")}))
