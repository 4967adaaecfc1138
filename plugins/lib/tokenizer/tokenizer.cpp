#include "lib/tokenizer/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cctype>
#include <climits>
#include <fstream>
#include <memory>
#include <queue>
#include <unordered_set>
#include <string_view>
#include <utility>

#include <wick/kit/json_fields.hpp>
#include <wick/options.hpp>

namespace wick::text {
namespace {

void widen_to_chars(const std::string& text, std::vector<std::pair<std::size_t, std::size_t>>& offsets);

class Bytes : public Tokenizer {
 public:
  explicit Bytes(std::vector<std::string> specials) : specials_(std::move(specials)) {}
  std::vector<std::int64_t> encode(const std::string& s, bool) const override {
    std::vector<std::int64_t> ids;
    ids.reserve(s.size());
    for (std::size_t i = 0; i < s.size();) {
      bool special = false;
      for (std::size_t k = 0; k < specials_.size() && !special; ++k)
        if (!specials_[k].empty() && s.compare(i, specials_[k].size(), specials_[k]) == 0) {
          ids.push_back(257 + static_cast<std::int64_t>(k));
          i += specials_[k].size();
          special = true;
        }
      if (!special) ids.push_back(static_cast<unsigned char>(s[i++]));
    }
    return ids;
  }
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const override {
    std::string s;
    for (auto id : ids)
      if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
      else if (id >= 257 && id < vocab_size() && !skip_special_tokens) s += specials_[static_cast<std::size_t>(id - 257)];
    return s;
  }
  Encoding encode_with_offsets(const std::string& s) const override {
    Encoding out;
    out.ids = encode(s, false);
    std::size_t at = 0;
    for (auto id : out.ids) {
      const std::size_t n = id >= 257 ? specials_[static_cast<std::size_t>(id - 257)].size() : 1;
      out.offsets.emplace_back(at, at + n);
      at += n;
    }
    widen_to_chars(s, out.offsets);
    return out;
  }
  std::int64_t vocab_size() const override { return 257 + static_cast<std::int64_t>(specials_.size()); }
  std::int64_t token_id(const std::string& t) const override {
    if (t == "<eos>") return 256;
    for (std::size_t k = 0; k < specials_.size(); ++k)
      if (specials_[k] == t) return 257 + static_cast<std::int64_t>(k);
    return -1;
  }

 private:
  std::vector<std::string> specials_;
};

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's map from bytes to printable characters (and back).
struct ByteMap {
  std::string to_char[256];
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteMap() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      std::uint32_t cp;
      if (std::find(bs.begin(), bs.end(), b) != bs.end()) cp = static_cast<std::uint32_t>(b);
      else cp = static_cast<std::uint32_t>(256 + n++);
      append_utf8(to_char[b], cp);
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The length of the UTF-8 character starting at s[i], by its first byte
// (cut short at the end of s).
std::size_t char_size(std::string_view s, std::size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
  return std::min(n, s.size() - i);
}

void widen_to_chars(const std::string& text, std::vector<std::pair<std::size_t, std::size_t>>& offsets) {
  auto start_of = [&](std::size_t i) {
    while (i > 0 && i < text.size() && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
    return i;
  };
  for (auto& [b, e] : offsets) {
    if (e <= b || e > text.size()) continue;
    const std::size_t last = start_of(e - 1);
    b = start_of(b);
    e = last + char_size(text, last);
  }
}

// UTF-8 characters of a string.
std::vector<std::string> chars(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size(); i += char_size(s, i)) out.push_back(s.substr(i, char_size(s, i)));
  return out;
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                          &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof buf);
      throw Error(where + ": its pre-tokenizer regex does not compile at offset " + std::to_string(off) + ": " +
                  reinterpret_cast<char*>(buf));
    }
    // pcre2_match then runs the compiled matcher (it interprets where the JIT is not available)
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  bool jit() const { return jit_; }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;

  // Split with "Isolated" behaviour: matches and the text between them are
  // pieces, as the tokenizers library splits: every match counts, an empty
  // one too (it cuts the text there), but not an empty match right where the
  // last match ended (the search then moves on one character). Calls
  // piece(offset, size) for each, in order.
  template <class F>
  void split(const std::string& s, F&& piece) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    std::size_t from = 0, prev = 0, last_end = 0;
    bool matched = false;
    // PCRE2 checks the UTF-8 from the start offset to the subject's end on
    // each call, which made a long line quadratic: the first call checks it
    // all (an invalid text stays one piece, as before), the others skip it
    std::uint32_t options = 0;
    while (from <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), from, options, md.get(), nullptr);
      if (rc < 0) break;
      options = PCRE2_NO_UTF_CHECK;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const std::size_t b = ov[0], e = ov[1];
      if (e == b && matched && e == last_end) {
        if (from >= s.size()) break;
        from += char_size(s, from);
        continue;
      }
      from = last_end = e;
      matched = true;
      if (b > prev) piece(prev, b - prev);
      if (e > b) piece(b, e - b);
      prev = e;
    }
    if (prev < s.size()) piece(prev, s.size() - prev);
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// utf8proc's normal forms of a string (NFC, NFKC).
std::string normal_form(const std::string& s, bool compat) {
  utf8proc_uint8_t* n = compat ? utf8proc_NFKC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()))
                               : utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
  if (!n) return s;
  std::string out = reinterpret_cast<char*>(n);
  std::free(n);
  return out;
}

// `s` with each occurrence of `from` (leftmost first, none overlapping)
// replaced by `to`, built in one pass into `out` (replacing in place moved the
// rest of the text at each occurrence: quadratic in a run of them). An empty
// `from` matches at every character boundary, the start and the end
// included, but not in an empty text, as the tokenizers library's Replace
// decoder does to each token ("ab" -> "XaXbX"). False as soon as `out` would
// pass `limit` bytes.
bool replace_into(std::string& out, std::string_view s, std::string_view from, std::string_view to,
                  std::size_t limit = std::string::npos) {
  out.clear();
  if (from.empty()) {
    if (s.empty()) return true;
    for (std::size_t i = 0; i < s.size(); i += char_size(s, i)) {
      if (out.size() + to.size() + char_size(s, i) > limit) return false;
      out.append(to).append(s.substr(i, char_size(s, i)));
    }
    if (out.size() + to.size() > limit) return false;
    out.append(to);
    return true;
  }
  std::size_t at = 0;
  for (std::size_t f = s.find(from); f != std::string_view::npos; f = s.find(from, at)) {
    if (out.size() + (f - at) + to.size() > limit) return false;
    out.append(s.substr(at, f - at)).append(to);
    at = f + from.size();
  }
  if (out.size() + (s.size() - at) > limit) return false;
  out.append(s.substr(at));
  return true;
}

std::string replaced(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  replace_into(out, s, from, to);
  return out;
}

// The code point at s[i] (a valid UTF-8 sequence), or -1.
std::int32_t code_point(const std::string& s, std::size_t i) {
  utf8proc_int32_t cp = -1;
  utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data()) + i, static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  return cp;
}

// A word character for added tokens' single_word (letters, marks, numbers, _), as the tokenizers library's \w.
bool word_char(std::int32_t cp) {
  if (cp < 0) return false;
  if (cp == '_') return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool valid_utf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    utf8proc_int32_t cp;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data()) + i,
                                    static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) return false;
    i += static_cast<std::size_t>(n);
  }
  return true;
}

// Whitespace, for added tokens' lstrip and rstrip: Unicode's White_Space, as Rust's char::is_whitespace.
bool space_char(std::int32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return true;
  if (cp < 0) return false;
  const auto c = utf8proc_category(cp);
  return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

// The start of the UTF-8 character that ends right before s[i].
std::size_t char_before(const std::string& s, std::size_t i) {
  std::size_t j = i - 1;
  while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
  return j;
}

// BPE from a Hugging Face tokenizer.json, as the tokenizers library runs it:
// added tokens (split out of the raw text, or of the normalized text for
// those marked normalized), a normalizer (NFC, NFKC, Prepend, Replace), a
// pre-tokenizer (ByteLevel, Split, Metaspace, or none: each segment one
// word), the BPE model (byte-level, or characters with byte fallback and an
// unknown token) and a post-processor (TemplateProcessing's single template,
// ByteLevel). What a file holds beyond that is refused by name.
class Bpe : public Tokenizer {
 public:
  explicit Bpe(const std::string& path) : path_(path) {
    const nlohmann::json json = wick::read_json_file(path);
    where_ = "tokenizer " + path;
    const wick::JsonFields j(json, where_);
    // encode() gives a text's ids whole, as transformers' tokenizer(text)
    // does (it turns these sections off unless a call asks for truncation or
    // padding): the data plugins cut each document to their max_length
    // (text_length) and pad batches themselves. Named, so that nobody expects
    // the file's max_length to act.
    for (const char* k : {"truncation", "padding"})
      if (j.has(k) && !json[k].is_null())
        std::fprintf(stderr, "wick: note: %s: its \"%s\" section is not applied (nor is it by transformers' "
                     "tokenizer() unless asked): wick's data plugins cut documents to their max_length option and "
                     "pad batches themselves\n", where_.c_str(), k);
    const wick::JsonFields m = j.object("model");
    if (m.string("type", "BPE") != "BPE") unsupported("model type " + m.string("type"));
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.has(k) && !m.json()[k].is_null() && !m.string(k).empty()) unsupported(std::string("model.") + k);
    if (m.has("dropout") && !m.json()["dropout"].is_null() && m.number("dropout", 0.0) > 0) unsupported("BPE dropout");
    // ids are u32, as the tokenizers library reads them
    constexpr std::int64_t kMaxId = 0xFFFFFFFFLL;
    const wick::JsonFields vocab = m.object("vocab");
    for (auto it = vocab.json().begin(); it != vocab.json().end(); ++it) {
      const std::int64_t id = vocab.integer(it.key(), 0, kMaxId);
      vocab_[it.key()] = id;
      max_id_ = std::max(max_id_, id);
    }
    // merges: "a b" or ["a", "b"], a, b and ab each in the vocabulary
    const auto& merges = m.array("merges");
    std::int64_t rank = 0;
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const auto& mg = merges[i];
      const std::string at = "model.merges[" + std::to_string(i) + "] is " + wick::json_brief(mg);
      std::string a, b;
      if (mg.is_string()) {
        const auto s = mg.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          throw Error(where_ + ": " + at + ", expected two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        a = mg[0].get<std::string>();
        b = mg[1].get<std::string>();
      } else {
        throw Error(where_ + ": " + at + ", expected \"a b\" or [\"a\", \"b\"]");
      }
      for (const auto& t : {a, b, a + b})
        if (!vocab_.count(t))
          throw Error(where_ + ": " + at + ", but '" + t + "' is not in model.vocab, expected merges of tokens in the vocabulary");
      // a merge given twice takes its last rank, as in tokenizers
      merges_[pair_key(vocab_[a], vocab_[b])] = {rank++, vocab_[a + b]};
    }
    ignore_merges_ = m.flag("ignore_merges", false);
    byte_fallback_ = m.flag("byte_fallback", false);
    fuse_unk_ = m.flag("fuse_unk", false);
    if (m.has("unk_token") && !m.json()["unk_token"].is_null()) {
      const std::string unk = m.string("unk_token");
      auto it = vocab_.find(unk);
      if (it == vocab_.end()) throw Error(where_ + ": model.unk_token '" + unk + "' is not in model.vocab");
      unk_ = it->second;
    }
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        auto it = vocab_.find(name);
        byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
      }
    read_added(j);
    for (auto& [s, id] : vocab_) {
      if (!added_ids_.count(id)) by_id_[id] = s;
      vocab_by_id_[id] = s;
    }
    read_normalizer(j);
    for (auto& a : added_) {
      a.pattern = a.normalized ? normalize(a.content) : a.content;
      by_id_[a.id] = added_ids_[a.id] = a.pattern;  // decoded as matched, as tokenizers' id_to_token gives it
    }
    std::erase_if(added_, [](const Added& a) { return a.pattern.empty(); });
    // the earliest match, the longest among those starting there
    std::stable_sort(added_.begin(), added_.end(), [](const Added& x, const Added& y) { return x.pattern.size() > y.pattern.size(); });
    for (std::size_t i = 0; i < added_.size(); ++i) {
      auto& table = first_byte_[added_[i].normalized];
      table.resize(256);
      table[static_cast<unsigned char>(added_[i].pattern[0])].push_back(i);
    }
    read_pre_tokenizer(j);
    read_post_processor(j);
    read_decoder(j);
  }

  std::vector<std::int64_t> encode(const std::string& text, bool add_special_tokens) const override {
    std::vector<std::int64_t> ids;
    // 1. added tokens matched in the raw text; 2. each segment between them
    // normalized, then those matched in normalized text; 3. the rest
    // pre-tokenized and run through BPE
    split_added(text, /*normalized=*/false, [&](const std::string& seg, std::int64_t id, bool at_start, std::size_t, std::size_t) {
      if (id >= 0) return ids.push_back(id);
      split_added(normalize(seg), /*normalized=*/true, [&](const std::string& part, std::int64_t id2, bool first, std::size_t, std::size_t) {
        if (id2 >= 0) return ids.push_back(id2);
        encode_normalized(part, at_start && first, ids);
      });
    });
    if (!add_special_tokens || template_.empty()) return ids;
    std::vector<std::int64_t> out;
    for (const auto& item : template_)
      if (item.empty()) out.insert(out.end(), ids.begin(), ids.end());  // the sequence itself
      else out.insert(out.end(), item.begin(), item.end());
    return out;
  }

  // The ids of the text (no post-processor template) and the bytes of the
  // text each came from, by the same steps as encode() with each byte's
  // origin carried through the normalizers and pre-tokenizers (the
  // tokenizers library's alignments): an inserted character (Prepend, a
  // Metaspace's or ByteLevel's prefix) takes the origin of the character it
  // stands before, a replacement the origin of what it replaced.
  Encoding encode_with_offsets(const std::string& text) const override {
    Encoding out;
    split_added(text, /*normalized=*/false, [&](const std::string& seg, std::int64_t id, bool at_start, std::size_t b, std::size_t e) {
      if (id >= 0) {
        out.ids.push_back(id);
        out.offsets.emplace_back(b, e);
        return;
      }
      Aligned raw;
      raw.s = seg;
      for (std::size_t i = 0; i < seg.size(); ++i) raw.b.push_back(b + i), raw.e.push_back(b + i + 1);
      const Aligned n = normalize_aligned(raw);
      split_added(n.s, /*normalized=*/true, [&](const std::string& part, std::int64_t id2, bool first, std::size_t pb, std::size_t pe) {
        if (id2 >= 0) {
          out.ids.push_back(id2);
          out.offsets.push_back(n.span(pb, pe - pb));
          return;
        }
        if (!part.empty()) pre_tokenize_aligned(n.slice(pb, pe - pb), at_start && first, 0, out);
      });
    });
    if (trim_offsets_) trim_offsets(out);
    widen_to_chars(text, out.offsets);
    return out;
  }

  // The ByteLevel post-processor's trim_offsets (tokenizers' process_offsets,
  // which runs with or without special tokens): each token's offsets leave
  // out its leading and trailing spaces (Ġ, or whitespace in an added
  // token's text), counted in characters of the token and taken off the
  // byte offsets as the library does; a first token's one leading space
  // stays with add_prefix_space.
  void trim_offsets(Encoding& enc) const {
    auto spaces = [](const std::vector<std::int32_t>& cs, bool from_end) {
      std::size_t n = 0;
      for (std::size_t k = 0; k < cs.size(); ++k) {
        const std::int32_t c = cs[from_end ? cs.size() - 1 - k : k];
        const bool ws = c == 0x120 || (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
                        (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
                        c == 0x3000;
        if (!ws) break;
        ++n;
      }
      return n;
    };
    for (std::size_t i = 0; i < enc.ids.size(); ++i) {
      const auto t = by_id_.find(enc.ids[i]);
      if (t == by_id_.end()) continue;
      std::vector<std::int32_t> cs;  // its characters (-1: no UTF-8)
      const std::string& tok = t->second;
      for (std::size_t k = 0; k < tok.size(); k += char_size(tok, k)) cs.push_back(code_point(tok, k));
      std::size_t lead = spaces(cs, false);
      const std::size_t trail = spaces(cs, true);
      auto& [b, e] = enc.offsets[i];
      if (lead > 0) {
        if ((i == 0 || b == 0) && trim_prefix_space_ && lead == 1) lead = 0;
        b = std::min(b + lead, e);
      }
      if (trail > 0 && e >= trail) e = std::max(e - trail, b);
    }
  }

  std::string decode(const std::vector<std::int64_t>& all, bool skip_special_tokens) const override {
    std::vector<std::int64_t> kept;
    if (skip_special_tokens)
      for (auto id : all)
        if (!special_ids_.count(id)) kept.push_back(id);
    const auto& ids = skip_special_tokens ? kept : all;
    if (byte_level_decoder_) return decode_byte_level(ids);
    // the tokens (added ones by their content), then the decoder's steps as
    // the tokenizers library applies them to the list
    std::vector<std::string> toks;
    for (auto id : ids)
      if (auto t = by_id_.find(id); t != by_id_.end()) toks.push_back(t->second);
    if (!has_decoder_) {  // the tokenizers library joins them with spaces
      std::string out;
      for (std::size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
      return out;
    }
    for (const auto& d : decoder_) {
      switch (d.kind) {
        case DecodeStep::Replace:
          for (auto& t : toks) t = replaced(t, d.a, d.b);
          break;
        case DecodeStep::Metaspace:  // the first token's replacements dropped (unless never prepended), the rest spaces
          for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = replaced(toks[i], d.a, i == 0 && d.n > 0 ? "" : " ");
          break;
        case DecodeStep::ByteFallback: {
          std::vector<std::string> out;
          std::string bytes;
          std::size_t run = 0;
          auto flush = [&] {
            if (!run) return;
            if (valid_utf8(bytes))
              out.push_back(bytes);
            else
              for (std::size_t k = 0; k < run; ++k) out.push_back("\xEF\xBF\xBD");  // U+FFFD for each byte
            bytes.clear();
            run = 0;
          };
          for (auto& t : toks) {
            if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
                std::isxdigit(static_cast<unsigned char>(t[4]))) {
              bytes.push_back(static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
              ++run;
              continue;
            }
            flush();
            out.push_back(std::move(t));
          }
          flush();
          toks.swap(out);
          break;
        }
        case DecodeStep::Fuse: {
          std::string all;
          for (auto& t : toks) all += t;
          toks.assign(1, all);
          break;
        }
        case DecodeStep::Strip:
          for (auto& t : toks) {
            for (std::int64_t k = 0; k < d.n && t.starts_with(d.a); ++k) t.erase(0, d.a.size());
            for (std::int64_t k = 0; k < d.m && t.ends_with(d.a); ++k) t.erase(t.size() - d.a.size());
          }
          break;
      }
    }
    std::string out;
    for (auto& t : toks) out += t;
    return out;
  }

  std::int64_t vocab_size() const override { return max_id_ + 1; }

  std::int64_t token_id(const std::string& t) const override {
    for (const auto& a : added_)
      if (a.content == t) return a.id;
    auto it = vocab_.find(t);
    return it == vocab_.end() ? -1 : it->second;
  }

  std::size_t cached_pieces() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return cache_.size();
  }
  bool regex_jit() const override {
    bool any = false;
    for (const auto& p : pre_)
      if (p.regex) {
        if (!p.regex->jit()) return false;
        any = true;
      }
    return any;
  }

 private:
  struct Added {
    std::string content;
    std::int64_t id;
    bool lstrip, rstrip, single_word, normalized;
    std::string pattern;  // what is matched: the content, normalized for `normalized` ones (as tokenizers does)
  };
  struct PreStep {
    enum Kind { Split, ByteLevel, Metaspace } kind;
    std::unique_ptr<Regex> regex;  // Split; ByteLevel with use_regex
    std::string replacement;       // Metaspace
    std::string prepend = "always";
    bool split = true, prefix_space = false;
  };
  struct NormStep {
    enum Kind { Nfc, Nfkc, Prepend, Replace } kind;
    std::string a, b;  // Prepend: the text; Replace: from, to
    std::string key;   // where tokenizer.json has it: "normalizer.normalizers[2]"
  };
  struct DecodeStep {
    enum Kind { Replace, Metaspace, ByteFallback, Fuse, Strip } kind;
    std::string a, b;       // Replace: from, to; Metaspace: the replacement; Strip: the content
    std::int64_t n = 0, m = 0;  // Strip: from the start, from the end; Metaspace: 1 to drop the first space
  };

  // A text and, for each of its bytes, the bytes [b, e) of the original text it came from.
  struct Aligned {
    std::string s;
    std::vector<std::size_t> b, e;
    Aligned slice(std::size_t at, std::size_t n) const {
      const auto i = static_cast<std::ptrdiff_t>(at), j = static_cast<std::ptrdiff_t>(at + n);
      return {s.substr(at, n), {b.begin() + i, b.begin() + j}, {e.begin() + i, e.begin() + j}};
    }
    // bytes [at, at + n)'s origin: from the first's start to the last's end
    std::pair<std::size_t, std::size_t> span(std::size_t at, std::size_t n) const {
      if (s.empty()) return {0, 0};
      at = std::min(at, s.size() - 1);
      n = std::max<std::size_t>(1, std::min(n, s.size() - at));
      std::size_t lo = b[at], hi = e[at];
      for (std::size_t k = at; k < at + n; ++k) lo = std::min(lo, b[k]), hi = std::max(hi, e[k]);
      return {lo, hi};
    }
    void push(std::string_view text, std::pair<std::size_t, std::size_t> from) {
      s.append(text);
      b.insert(b.end(), text.size(), from.first);
      e.insert(e.end(), text.size(), from.second);
    }
    void append(const Aligned& x) {
      s += x.s;
      b.insert(b.end(), x.b.begin(), x.b.end());
      e.insert(e.end(), x.e.begin(), x.e.end());
    }
  };

  // normalize() with the origins: NFC and NFKC one run at a time (a starter
  // and the marks after it); where that does not give normalize()'s text,
  // every byte comes from the whole segment.
  Aligned normalize_aligned(const Aligned& in) const {
    const std::string want = normalize(in.s);  // its limits checked, as encode() checks them
    Aligned a = in;
    for (const auto& n : norm_) {
      Aligned out;
      switch (n.kind) {
        case NormStep::Nfc:
        case NormStep::Nfkc: {
          const bool compat = n.kind == NormStep::Nfkc;
          if (normal_form(a.s, compat) == a.s) continue;
          for (std::size_t i = 0; i < a.s.size();) {
            std::size_t j = i + char_size(a.s, i);
            while (j < a.s.size()) {
              const auto cp = code_point(a.s, j);
              if (cp < 0 || utf8proc_get_property(cp)->combining_class == 0) break;
              j += char_size(a.s, j);
            }
            out.push(normal_form(a.s.substr(i, j - i), compat), a.span(i, j - i));
            i = j;
          }
          break;
        }
        case NormStep::Prepend:
          if (a.s.empty()) continue;
          out.push(n.a, a.span(0, char_size(a.s, 0)));
          out.append(a);
          break;
        case NormStep::Replace: {
          std::size_t at = 0;
          for (std::size_t f = a.s.find(n.a); f != std::string::npos; f = a.s.find(n.a, at)) {
            out.append(a.slice(at, f - at));
            out.push(n.b, a.span(f, n.a.size()));
            at = f + n.a.size();
          }
          out.append(a.slice(at, a.s.size() - at));
          break;
        }
      }
      a = std::move(out);
    }
    if (a.s == want) return a;
    Aligned whole;
    whole.push(want, in.span(0, in.s.size()));
    return whole;
  }

  // pre_tokenize() with the origins.
  void pre_tokenize_aligned(const Aligned& p, bool first, std::size_t k, Encoding& out) const {
    if (k == pre_.size()) return bpe_aligned(p, out);
    const PreStep& step = pre_[k];
    if (step.kind == PreStep::Metaspace) {
      const std::string& r = step.replacement;
      Aligned q;
      std::size_t at = 0;
      for (std::size_t f = p.s.find(' '); f != std::string::npos; f = p.s.find(' ', at)) {
        q.append(p.slice(at, f - at));
        q.push(r, p.span(f, 1));
        at = f + 1;
      }
      q.append(p.slice(at, p.s.size() - at));
      if ((step.prepend == "always" || (step.prepend == "first" && first)) && !q.s.starts_with(r)) {
        Aligned pre;
        pre.push(r, q.span(0, q.s.empty() ? 0 : char_size(q.s, 0)));
        pre.append(q);
        q = std::move(pre);
      }
      if (!step.split) return pre_tokenize_aligned(q, first, k + 1, out);
      std::size_t cut = 0;
      bool f = first;
      for (std::size_t c = q.s.find(r); c != std::string::npos; c = q.s.find(r, c + r.size()))
        if (c > cut) {
          pre_tokenize_aligned(q.slice(cut, c - cut), std::exchange(f, false), k + 1, out);
          cut = c;
        }
      if (cut < q.s.size()) pre_tokenize_aligned(q.slice(cut, q.s.size() - cut), f, k + 1, out);
      return;
    }
    Aligned prefixed;
    if (step.kind == PreStep::ByteLevel && step.prefix_space && !p.s.starts_with(" ")) {
      prefixed.push(" ", p.span(0, p.s.empty() ? 0 : char_size(p.s, 0)));
      prefixed.append(p);
    }
    const Aligned& q = prefixed.s.empty() ? p : prefixed;
    if (!step.regex) return pre_tokenize_aligned(q, first, k + 1, out);
    bool f = first;
    step.regex->split(q.s, [&](std::size_t at, std::size_t n) { pre_tokenize_aligned(q.slice(at, n), std::exchange(f, false), k + 1, out); });
  }

  // bpe() over a piece, each token given the origin of the bytes of the piece it spells.
  void bpe_aligned(const Aligned& p, Encoding& out) const {
    std::vector<std::int64_t> ids;
    bpe(p.s, ids);
    std::size_t at = 0;
    for (auto id : ids) {
      const std::size_t n = std::min(token_bytes(p.s, at, id), p.s.size() - at);
      out.ids.push_back(id);
      out.offsets.push_back(p.span(at, n));
      at += n;
    }
  }

  // How many bytes of `piece` from `at` token `id` spells.
  std::size_t token_bytes(const std::string& piece, std::size_t at, std::int64_t id) const {
    const auto v = vocab_by_id_.find(id);
    if (byte_level_) return v == vocab_by_id_.end() ? 1 : chars(v->second).size();  // one character a byte
    if (v != vocab_by_id_.end() && id != unk_ && piece.compare(at, v->second.size(), v->second) == 0) return v->second.size();
    if (byte_fallback_ && v != vocab_by_id_.end() && v->second.size() == 6 && v->second.starts_with("<0x")) return 1;
    if (id != unk_ || at >= piece.size()) return v == vocab_by_id_.end() ? 1 : v->second.size();
    // the unknown token: one character, or with fuse_unk the run of characters outside the vocabulary
    auto unknown = [&](std::size_t i) {
      const std::string c = piece.substr(i, char_size(piece, i));
      if (vocab_.count(c)) return false;
      if (!byte_fallback_) return true;
      for (unsigned char ch : c)
        if (byte_ids_[ch] < 0) return true;
      return false;
    };
    std::size_t n = char_size(piece, at);
    while (fuse_unk_ && at + n < piece.size() && unknown(at + n)) n += char_size(piece, at + n);
    return n;
  }

  [[noreturn]] void unsupported(const std::string& what) const {
    throw Error(where_ + " uses " + what + ", which wick does not support (BPE: byte-level as GPT-2, Qwen2 and "
                "LLaMA-3 use it, or with byte fallback as LLaMA-2, Mistral and LLaVA-1.5 use it)");
  }

  static std::uint64_t pair_key(std::int64_t a, std::int64_t b) {
    return (static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint64_t>(b);
  }

  // A pipeline stage (normalizer, pre_tokenizer, ...): the steps of its
  // Sequence (under `list`), or the one step it is; errors name the key.
  std::vector<wick::JsonFields> steps_of(const wick::JsonFields& j, const std::string& key, const std::string& list) const {
    const wick::JsonFields stage = j.object(key);
    if (stage.string("type") != "Sequence") return {stage};
    std::vector<wick::JsonFields> steps;
    const auto& items = stage.array(list);
    for (std::size_t i = 0; i < items.size(); ++i)
      steps.emplace_back(items[i], where_, key + "." + list + "[" + std::to_string(i) + "].");
    return steps;
  }

  void read_added(const wick::JsonFields& j) {
    if (!j.has("added_tokens")) return;
    constexpr std::int64_t kMaxId = 0xFFFFFFFFLL;
    const auto& added = j.array("added_tokens");
    for (std::size_t i = 0; i < added.size(); ++i) {
      const wick::JsonFields t(added[i], where_, "added_tokens[" + std::to_string(i) + "].");
      Added a{t.string("content"), t.integer("id", 0, kMaxId), t.flag("lstrip", false), t.flag("rstrip", false),
              t.flag("single_word", false), t.flag("normalized", !t.flag("special", false))};
      max_id_ = std::max(max_id_, a.id);
      by_id_[a.id] = a.content, added_ids_[a.id] = a.content;
      if (t.flag("special", false)) special_ids_.insert(a.id);
      added_.push_back(std::move(a));  // an empty one never matches, as in tokenizers (dropped below)
    }
  }

  void read_normalizer(const wick::JsonFields& j) {
    if (!j.has("normalizer") || j.json()["normalizer"].is_null()) return;
    const auto steps = steps_of(j, "normalizer", "normalizers");
    const bool sequence = j.object("normalizer").string("type") == "Sequence";
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const auto& s = steps[i];
      const std::string t = s.string("type"), key = sequence ? "normalizer.normalizers[" + std::to_string(i) + "]" : "normalizer";
      if (t == "NFC") norm_.push_back({NormStep::Nfc, "", "", key});
      else if (t == "NFKC") norm_.push_back({NormStep::Nfkc, "", "", key});
      else if (t == "Prepend") norm_.push_back({NormStep::Prepend, s.string("prepend"), "", key});
      else if (t == "Replace") {
        const wick::JsonFields pat = s.object("pattern");
        if (!pat.has("String")) unsupported("a Replace normalizer with a regex pattern");
        // tokenizers puts the content at every character boundary, and then
        // cuts pieces by its offset bookkeeping, not by the normalized text
        // ("Gr" becomes "_G_r_", but the pieces "__", "G", "_", "r", "_")
        if (pat.string("String").empty())
          pat.bad("String", "a non-empty string (the tokenizers library inserts the content at every character "
                            "boundary and cuts the result by its offsets, which wick does not reproduce)");
        norm_.push_back({NormStep::Replace, pat.string("String"), s.string("content"), key});
      } else unsupported("normalizer " + t);
    }
  }

  void read_pre_tokenizer(const wick::JsonFields& j) {
    if (!j.has("pre_tokenizer") || j.json()["pre_tokenizer"].is_null()) return;  // each segment one word
    for (const auto& s : steps_of(j, "pre_tokenizer", "pretokenizers")) {
      const std::string t = s.string("type");
      PreStep step;
      if (t == "Split") {
        if (s.string("behavior") != "Isolated" || s.flag("invert", false))
          unsupported("Split behaviour " + s.string("behavior") + (s.flag("invert", false) ? " inverted" : ""));
        const wick::JsonFields pattern = s.object("pattern");
        if (!pattern.has("Regex")) unsupported("a Split on a plain string");
        step.kind = PreStep::Split;
        step.regex = std::make_unique<Regex>(pattern.string("Regex"), where_);
      } else if (t == "ByteLevel") {
        step.kind = PreStep::ByteLevel;
        byte_level_ = true;
        step.prefix_space = s.flag("add_prefix_space", false);
        if (s.flag("use_regex", true)) step.regex = std::make_unique<Regex>(kGpt2Pattern, where_);
      } else if (t == "Metaspace") {
        step.kind = PreStep::Metaspace;
        step.replacement = s.string("replacement");
        if (chars(step.replacement).size() != 1) throw Error(where_ + ": Metaspace's replacement must be one character");
        step.prepend = s.has("prepend_scheme") ? s.string("prepend_scheme")
                                               : (s.flag("add_prefix_space", true) ? "always" : "never");
        if (step.prepend != "always" && step.prepend != "first" && step.prepend != "never")
          s.bad("prepend_scheme", "\"always\", \"first\" or \"never\"");
        step.split = s.flag("split", true);
      } else {
        unsupported("pre-tokenizer " + t);
      }
      pre_.push_back(std::move(step));
    }
  }

  void read_post_processor(const wick::JsonFields& j) {
    if (!j.has("post_processor") || j.json()["post_processor"].is_null()) return;
    for (const auto& s : steps_of(j, "post_processor", "processors")) {
      const std::string t = s.string("type");
      if (t == "ByteLevel") {  // offsets only: the ids stay
        trim_offsets_ = s.flag("trim_offsets", true);  // the library's defaults
        trim_prefix_space_ = s.flag("add_prefix_space", true);
        continue;
      }
      if (t != "TemplateProcessing") unsupported("post-processor " + t);
      const auto& single = s.array("single");
      std::map<std::string, std::vector<std::int64_t>> specials;
      if (s.has("special_tokens")) {
        const wick::JsonFields sp = s.object("special_tokens");
        for (auto it = sp.json().begin(); it != sp.json().end(); ++it) {
          const wick::JsonFields one(it.value(), where_, "post_processor.special_tokens." + it.key() + ".");
          for (const auto& id : one.array("ids")) {
            if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() > max_id_)
              one.bad("ids", "a list of token ids of the vocabulary (0 to " + std::to_string(max_id_) + ")");
            specials[it.key()].push_back(id.get<std::int64_t>());
          }
        }
      }
      template_.clear();
      bool sequence = false;
      for (std::size_t i = 0; i < single.size(); ++i) {
        const wick::JsonFields item(single[i], where_, "post_processor.single[" + std::to_string(i) + "].");
        if (item.has("Sequence")) {
          const std::string id = item.object("Sequence").string("id");
          if (id != "A") throw Error(where_ + ": post_processor.single[" + std::to_string(i) + "] is sequence '" + id +
                                     "', expected A in the template for one sequence");
          template_.emplace_back();
          sequence = true;
        } else if (sequence) {
          // a data set appends its own end-of-text token after the text: a template's tokens after the
          // sequence (T5's "$A </s>") would land between a prompt and its completion
          unsupported("a post-processor template with tokens after the sequence (post_processor.single[" +
                      std::to_string(i) + "])");
        } else if (item.has("SpecialToken")) {
          const std::string id = item.object("SpecialToken").string("id");
          auto it = specials.find(id);
          if (it == specials.end() || it->second.empty())
            throw Error(where_ + ": post_processor.single[" + std::to_string(i) + "] is special token '" + id +
                        "', which post_processor.special_tokens does not define");
          template_.push_back(it->second);
        } else {
          throw Error(where_ + ": post_processor.single[" + std::to_string(i) + "] is " + wick::json_brief(single[i]) +
                      ", expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
        }
      }
      if (!sequence) throw Error(where_ + ": post_processor.single has no Sequence A: the text's own ids would be lost");
    }
  }

  void read_decoder(const wick::JsonFields& j) {
    byte_level_decoder_ = byte_level_;  // with no decoder, byte-level text still maps back to bytes
    if (!j.has("decoder") || j.json()["decoder"].is_null()) {
      has_decoder_ = byte_level_;
      return;
    }
    has_decoder_ = true;
    const auto steps = steps_of(j, "decoder", "decoders");
    byte_level_decoder_ = steps.size() == 1 && steps[0].string("type") == "ByteLevel";
    for (const auto& s : steps) {
      const std::string t = s.string("type");
      if (t == "ByteLevel") {
        if (!byte_level_decoder_) unsupported("a ByteLevel decoder inside a sequence of decoders");
      } else if (t == "Metaspace") {
        const std::string scheme = s.has("prepend_scheme") ? s.string("prepend_scheme")
                                                          : (s.flag("add_prefix_space", true) ? "always" : "never");
        decoder_.push_back({DecodeStep::Metaspace, s.string("replacement"), "", scheme != "never", 0});
      } else if (t == "Replace") {
        const wick::JsonFields pat = s.object("pattern");
        if (!pat.has("String")) unsupported("a Replace decoder with a regex pattern");
        decoder_.push_back({DecodeStep::Replace, pat.string("String"), s.string("content"), 0, 0});
      } else if (t == "ByteFallback") {
        decoder_.push_back({DecodeStep::ByteFallback, "", "", 0, 0});
      } else if (t == "Fuse") {
        decoder_.push_back({DecodeStep::Fuse, "", "", 0, 0});
      } else if (t == "Strip") {
        decoder_.push_back({DecodeStep::Strip, s.string("content"), "", s.integer("start", 0, 0, 1 << 20),
                            s.integer("stop", 0, 0, 1 << 20)});
      } else {
        unsupported("decoder " + t);
      }
    }
  }

  // The normalizers in turn. Each step's text is bounded (kNormGrowth times
  // the input's size plus kNormSlack bytes; NFKC grows text at most 11-fold,
  // a Replace of " " with "\u2581" 3-fold): a stack of Replace "a" -> "aa"
  // doubles it at each step, and the tokenizers library then runs for ever.
  std::string normalize(std::string s) const {
    const std::size_t size = s.size(), limit = kNormGrowth * size + kNormSlack;
    for (const auto& n : norm_) {
      switch (n.kind) {
        case NormStep::Nfc: s = normal_form(s, false); break;
        case NormStep::Nfkc: s = normal_form(s, true); break;
        case NormStep::Prepend: if (!s.empty()) s = n.a + s; break;
        case NormStep::Replace: {
          std::string out;
          if (!replace_into(out, s, n.a, n.b, limit)) too_long(n, size, limit);
          s.swap(out);
          break;
        }
      }
      if (s.size() > limit) too_long(n, size, limit);
    }
    return s;
  }

  [[noreturn]] void too_long(const NormStep& n, std::size_t size, std::size_t limit) const {
    std::string step = n.kind == NormStep::Replace ? "Replace " + wick::json_brief(n.a) + " with " + wick::json_brief(n.b)
                       : n.kind == NormStep::Prepend ? "Prepend " + wick::json_brief(n.a)
                       : n.kind == NormStep::Nfc ? "NFC" : "NFKC";
    throw Error(where_ + ": " + n.key + " (" + step + ") makes a text of " + std::to_string(size) +
                " bytes longer than " + std::to_string(limit) + " bytes, the limit on normalized text (" +
                std::to_string(kNormGrowth) + " times the text's size plus " + std::to_string(kNormSlack) +
                " bytes): a normalizer that multiplies the text is refused rather than run for ever");
  }

  // Calls emit(segment, -1, at_start, begin, end) for text and emit("", id, false, begin, end) for
  // the added tokens (those with `normalized` as given) found in `text`:
  // the earliest match, the longest there; single_word ones only between
  // non-word characters; lstrip/rstrip ones take the whitespace beside them.
  // One pass over the text: at each byte only the tokens starting with it
  // are tried (searching the rest of the text for each token at each match
  // was quadratic in the matches).
  template <class F>
  void split_added(const std::string& text, bool normalized, F&& emit) const {
    const auto& first = first_byte_[normalized];
    std::size_t pos = 0;
    for (std::size_t f = 0; f < text.size() && !first.empty(); ++f) {
      const auto& cands = first[static_cast<unsigned char>(text[f])];
      const Added* tok = nullptr;
      for (std::size_t k = 0; k < cands.size() && !tok; ++k) {
        const Added& a = added_[cands[k]];
        if (text.compare(f, a.pattern.size(), a.pattern) != 0) continue;
        const std::size_t e = f + a.pattern.size();
        if (a.single_word && ((f > 0 && word_char(code_point(text, char_before(text, f)))) ||
                              (e < text.size() && word_char(code_point(text, e)))))
          continue;
        tok = &a;
      }
      if (!tok) continue;
      std::size_t b = f, e = f + tok->pattern.size();
      if (tok->lstrip)
        while (b > pos && space_char(code_point(text, char_before(text, b)))) b = char_before(text, b);
      if (tok->rstrip)
        while (e < text.size() && space_char(code_point(text, e))) e += char_size(text, e);
      if (b > pos) emit(text.substr(pos, b - pos), -1, pos == 0, pos, b);
      emit(std::string(), tok->id, false, b, e);
      pos = e;
      f = e - 1;  // the next match starts at e or after
    }
    if (pos == 0 && !text.empty()) emit(text, -1, true, 0, text.size());
    else if (pos < text.size()) emit(text.substr(pos), -1, false, pos, text.size());
  }

  // Pre-tokenizes one normalized segment and runs BPE over each piece.
  void encode_normalized(const std::string& s, bool at_start, std::vector<std::int64_t>& ids) const {
    if (!s.empty()) pre_tokenize(s, at_start, 0, ids);
  }

  // Runs the pre-tokenizer's steps from the k-th on over one piece (whether
  // it begins the input: `first`), each piece a step cuts going through the
  // next steps at once, then through BPE: no step holds all of a long line's
  // pieces.
  void pre_tokenize(const std::string& p, bool first, std::size_t k, std::vector<std::int64_t>& ids) const {
    if (k == pre_.size()) return bpe(p, ids);
    const PreStep& step = pre_[k];
    if (step.kind == PreStep::Metaspace) {
      const std::string& r = step.replacement;
      std::string q = replaced(p, " ", r);
      if ((step.prepend == "always" || (step.prepend == "first" && first)) && !q.starts_with(r)) q = r + q;
      if (!step.split) return pre_tokenize(q, first, k + 1, ids);
      // cut before each replacement: each joined to what follows it up to the next
      std::size_t cut = 0;
      bool f = first;
      for (std::size_t at = q.find(r); at != std::string::npos; at = q.find(r, at + r.size()))
        if (at > cut) {
          pre_tokenize(q.substr(cut, at - cut), std::exchange(f, false), k + 1, ids);
          cut = at;
        }
      if (cut < q.size()) pre_tokenize(q.substr(cut), f, k + 1, ids);
      return;
    }
    std::string prefixed;
    if (step.kind == PreStep::ByteLevel && step.prefix_space && !p.starts_with(" ")) prefixed = " " + p;
    const std::string& q = prefixed.empty() ? p : prefixed;
    if (!step.regex) return pre_tokenize(q, first, k + 1, ids);
    bool f = first;
    step.regex->split(q, [&](std::size_t at, std::size_t n) { pre_tokenize(q.substr(at, n), std::exchange(f, false), k + 1, ids); });
  }

  void bpe(const std::string& piece, std::vector<std::int64_t>& ids) const {
    if (piece.empty()) return;
    const bool cacheable = piece.size() <= kCachedPieceBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = cache_.find(piece); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::string word;
    if (byte_level_)
      for (unsigned char c : piece) word += byte_map().to_char[c];
    else
      word = piece;
    std::vector<std::int64_t> out;
    if (auto whole = vocab_.find(word); ignore_merges_ && whole != vocab_.end()) out.push_back(whole->second);
    else out = merge(word);
    ids.insert(ids.end(), out.begin(), out.end());
    if (!cacheable) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_.size() >= kCacheEntries) cache_.clear();  // bounded: a long run over varied text does not grow it
    cache_.emplace(piece, std::move(out));
  }

  // The word's characters as ids (bytes for those outside the vocabulary
  // with byte fallback, else the unknown token, runs of it fused when
  // asked), then the lowest-ranked merge first, the leftmost among equals,
  // until none applies: the tokenizers library's order, in O(n log n).
  std::vector<std::int64_t> merge(const std::string& word) const {
    std::vector<std::int64_t> sym;
    std::string c;  // one character at a time: a long word's characters are never held as strings at once
    for (std::size_t at = 0; at < word.size(); at += c.size()) {
      c.assign(word, at, char_size(word, at));
      if (auto it = vocab_.find(c); it != vocab_.end()) {
        sym.push_back(it->second);
        continue;
      }
      bool bytes = byte_fallback_;
      for (unsigned char b : c) bytes = bytes && byte_ids_[b] >= 0;
      if (bytes) {
        for (unsigned char b : c) sym.push_back(byte_ids_[b]);
        continue;
      }
      if (unk_ < 0) {
        char cp[16];
        std::snprintf(cp, sizeof cp, "U+%04X", static_cast<unsigned>(std::max(0, code_point(c, 0))));
        throw Error(where_ + ": the text holds '" + c + "' (" + cp + "), which is not in the vocabulary, and the model "
                    "has neither byte_fallback nor an unk_token to stand for it (the tokenizers library would drop it "
                    "without a word)");
      }
      if (fuse_unk_ && !sym.empty() && sym.back() == unk_) continue;
      sym.push_back(unk_);
    }
    const std::size_t n = sym.size();
    std::vector<std::int64_t> prev(n), next(n);
    for (std::size_t i = 0; i < n; ++i) prev[i] = static_cast<std::int64_t>(i) - 1, next[i] = i + 1 < n ? static_cast<std::int64_t>(i) + 1 : -1;
    std::vector<bool> gone(n, false);
    using Item = std::pair<std::int64_t, std::int64_t>;  // rank, position
    std::priority_queue<Item, std::vector<Item>, std::greater<>> heap;
    auto push = [&](std::int64_t i) {
      if (i < 0 || next[i] < 0) return;
      if (auto m = merges_.find(pair_key(sym[i], sym[next[i]])); m != merges_.end()) heap.emplace(m->second.first, i);
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(static_cast<std::int64_t>(i));
    while (!heap.empty()) {
      const auto [rank, i] = heap.top();
      heap.pop();
      if (gone[i] || next[i] < 0) continue;
      auto m = merges_.find(pair_key(sym[i], sym[next[i]]));
      if (m == merges_.end() || m->second.first != rank) continue;  // the pair changed since it was queued
      const std::int64_t j = next[i];
      sym[i] = m->second.second;
      gone[j] = true;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      push(prev[i]);
      push(i);
    }
    std::vector<std::int64_t> out;
    for (std::int64_t i = n ? 0 : -1; i >= 0; i = next[i]) out.push_back(sym[i]);
    return out;
  }

  std::string decode_byte_level(const std::vector<std::int64_t>& ids) const {
    std::string out, pending, c;
    auto flush = [&] {
      for (std::size_t at = 0; at < pending.size(); at += c.size()) {
        c.assign(pending, at, char_size(pending, at));
        auto it = byte_map().to_byte.find(c);
        if (it != byte_map().to_byte.end()) out.push_back(static_cast<char>(it->second));
      }
      pending.clear();
    };
    for (auto id : ids) {
      if (auto a = added_ids_.find(id); a != added_ids_.end()) {
        flush();
        out += a->second;
      } else if (auto t = by_id_.find(id); t != by_id_.end()) {
        pending += t->second;
      }
    }
    flush();
    return out;
  }

  static constexpr std::size_t kCachedPieceBytes = 256, kCacheEntries = 1 << 16;
  static constexpr std::size_t kNormGrowth = 64, kNormSlack = 4096;
  std::string path_, where_;
  std::unordered_map<std::string, std::int64_t> vocab_;
  std::unordered_map<std::uint64_t, std::pair<std::int64_t, std::int64_t>> merges_;  // (a, b) -> rank, merged id
  std::unordered_map<std::int64_t, std::string> by_id_, added_ids_, vocab_by_id_;
  std::unordered_set<std::int64_t> special_ids_;
  std::vector<Added> added_;
  // [normalized][first byte]: the added tokens whose pattern starts with it,
  // in added_'s order (longest first); empty where there are none
  std::vector<std::vector<std::size_t>> first_byte_[2];
  std::vector<NormStep> norm_;
  std::vector<PreStep> pre_;
  std::vector<std::vector<std::int64_t>> template_;  // the single template: special ids, {} for the sequence
  std::int64_t byte_ids_[256];
  std::int64_t unk_ = -1;
  bool byte_level_ = false, ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  bool byte_level_decoder_ = false, has_decoder_ = false;
  bool trim_offsets_ = false, trim_prefix_space_ = false;  // the ByteLevel post-processor's
  std::vector<DecodeStep> decoder_;
  std::int64_t max_id_ = -1;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::vector<std::int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer(const std::vector<std::string>& specials) {
  return std::make_unique<Bytes>(specials);
}
std::string default_eos(const Tokenizer& t) {
  for (const char* e : {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"})
    if (t.token_id(e) >= 0) return e;
  return "<|endoftext|>";
}

std::unique_ptr<Tokenizer> bpe_tokenizer(const std::string& path) { return std::make_unique<Bpe>(path); }

}  // namespace wick::text
