#include "lib/tokenizer/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <fstream>

#include <wick/kit/json_fields.hpp>
#include <wick/options.hpp>

namespace wick::text {
namespace {

class Bytes : public Tokenizer {
 public:
  explicit Bytes(std::vector<std::string> specials) : specials_(std::move(specials)) {}
  std::vector<std::int64_t> encode(const std::string& s) const override {
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
  std::string decode(const std::vector<std::int64_t>& ids) const override {
    std::string s;
    for (auto id : ids)
      if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
      else if (id >= 257 && id < vocab_size()) s += specials_[static_cast<std::size_t>(id - 257)];
    return s;
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

// UTF-8 characters of a string.
std::vector<std::string> chars(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
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
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;

  // Split with "Isolated" behaviour: matches and the text between them are
  // pieces, as the tokenizers library splits: every match counts, an empty
  // one too (it cuts the text there), but not an empty match right where the
  // last match ended (the search then moves on one character).
  std::vector<std::string> split(const std::string& s) const {
    std::vector<std::string> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    std::size_t from = 0, prev = 0, last_end = 0;
    bool matched = false;
    while (from <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), from, 0, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const std::size_t b = ov[0], e = ov[1];
      if (e == b && matched && e == last_end) {
        if (from >= s.size()) break;
        from += chars(s.substr(from, 4)).front().size();
        continue;
      }
      from = last_end = e;
      matched = true;
      if (b > prev) out.push_back(s.substr(prev, b - prev));
      if (e > b) out.push_back(s.substr(b, e - b));
      prev = e;
    }
    if (prev < s.size()) out.push_back(s.substr(prev));
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class Bpe : public Tokenizer {
 public:
  explicit Bpe(const std::string& path) : path_(path) {
    const nlohmann::json json = wick::read_json_file(path);
    const std::string where = "tokenizer " + path;
    const wick::JsonFields j(json, where);
    const wick::JsonFields m = j.object("model");
    if (m.string("type", "BPE") != "BPE") unsupported("model type " + m.string("type"));
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
          throw Error(where + ": " + at + ", expected two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        a = mg[0].get<std::string>();
        b = mg[1].get<std::string>();
      } else {
        throw Error(where + ": " + at + ", expected \"a b\" or [\"a\", \"b\"]");
      }
      for (const auto& t : {a, b, a + b})
        if (!vocab_.count(t))
          throw Error(where + ": " + at + ", but '" + t + "' is not in model.vocab, expected merges of tokens in the vocabulary");
      ranks_[a + '\x01' + b] = rank++;  // a merge given twice takes its last rank, as in tokenizers
    }
    ignore_merges_ = m.flag("ignore_merges", false);
    if (j.has("added_tokens")) {
      const auto& added = j.array("added_tokens");
      for (std::size_t i = 0; i < added.size(); ++i) {
        const wick::JsonFields t(added[i], where, "added_tokens[" + std::to_string(i) + "].");
        const std::string content = t.string("content");
        const std::int64_t id = t.integer("id", 0, kMaxId);
        max_id_ = std::max(max_id_, id);
        by_id_[id] = content, added_ids_[id] = content;
        if (!content.empty()) added_.emplace_back(content, id);  // an empty one never matches, as in tokenizers
      }
    }
    std::sort(added_.begin(), added_.end(), [](auto& x, auto& y) { return x.first.size() > y.first.size(); });
    for (auto& [s, id] : vocab_)
      if (!added_ids_.count(id)) by_id_[id] = s;
    // normalizer: none or NFC
    if (j.has("normalizer")) {
      const wick::JsonFields n = j.object("normalizer");
      const std::string t = n.string("type");
      if (t == "NFC") nfc_ = true;
      else if (!(t == "Sequence" && n.array("normalizers").empty())) unsupported("normalizer " + t);
    }
    // pre-tokenizer: ByteLevel, or a Sequence of Split(Isolated) and ByteLevel
    if (!j.has("pre_tokenizer")) unsupported("no pre-tokenizer (expected ByteLevel)");
    const wick::JsonFields pt = j.object("pre_tokenizer");
    std::vector<wick::JsonFields> steps;
    const nlohmann::json* list = nullptr;
    if (pt.string("type") == "Sequence") {
      list = &pt.array("pretokenizers");
      for (std::size_t i = 0; i < list->size(); ++i)
        steps.emplace_back((*list)[i], where, "pre_tokenizer.pretokenizers[" + std::to_string(i) + "].");
    } else {
      steps.push_back(pt);
    }
    for (const auto& s : steps) {
      const std::string t = s.string("type");
      if (t == "Split") {
        if (s.string("behavior") != "Isolated" || s.flag("invert", false))
          unsupported("Split behaviour " + s.string("behavior") + (s.flag("invert", false) ? " inverted" : ""));
        const wick::JsonFields pattern = s.object("pattern");
        if (!pattern.has("Regex")) unsupported("a Split on a plain string");
        splits_.push_back(std::make_unique<Regex>(pattern.string("Regex"), "tokenizer " + path));
      } else if (t == "ByteLevel") {
        byte_level_ = true;
        prefix_space_ = s.flag("add_prefix_space", false);
        if (s.flag("use_regex", true)) splits_.push_back(std::make_unique<Regex>(kGpt2Pattern, "tokenizer " + path));
      } else {
        unsupported("pre-tokenizer " + t);
      }
    }
    if (!byte_level_) unsupported("a pre-tokenizer without ByteLevel");
  }

  std::vector<std::int64_t> encode(const std::string& text) const override {
    std::vector<std::int64_t> ids;
    // added and special tokens first: the text between them is tokenized
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t best = std::string::npos;
      const std::pair<std::string, std::int64_t>* tok = nullptr;
      for (const auto& a : added_) {  // longest first: the earliest, then longest, match
        const auto f = text.find(a.first, pos);
        if (f != std::string::npos && (best == std::string::npos || f < best)) best = f, tok = &a;
      }
      encode_plain(text.substr(pos, best == std::string::npos ? std::string::npos : best - pos), ids);
      if (!tok) break;
      ids.push_back(tok->second);
      pos = best + tok->first.size();
    }
    return ids;
  }

  std::string decode(const std::vector<std::int64_t>& ids) const override {
    std::string out, pending;
    auto flush = [&] {
      for (const auto& c : chars(pending)) {
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

  std::int64_t vocab_size() const override { return max_id_ + 1; }

  std::int64_t token_id(const std::string& t) const override {
    for (const auto& a : added_)
      if (a.first == t) return a.second;
    auto it = vocab_.find(t);
    return it == vocab_.end() ? -1 : it->second;
  }

 private:
  [[noreturn]] void unsupported(const std::string& what) const {
    throw Error("tokenizer " + path_ + " uses " + what + ", which wick does not support (byte-level BPE only)");
  }

  void encode_plain(std::string s, std::vector<std::int64_t>& ids) const {
    if (s.empty()) return;
    if (nfc_) {
      utf8proc_uint8_t* n = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
      if (n) {
        s = reinterpret_cast<char*>(n);
        std::free(n);
      }
    }
    if (prefix_space_ && s[0] != ' ') s = " " + s;
    std::vector<std::string> pieces{s};
    for (const auto& re : splits_) {
      std::vector<std::string> next;
      for (const auto& p : pieces)
        for (auto& q : re->split(p)) next.push_back(std::move(q));
      pieces.swap(next);
    }
    for (const auto& p : pieces) bpe(p, ids);
  }

  void bpe(const std::string& piece, std::vector<std::int64_t>& ids) const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = cache_.find(piece); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::string mapped;
    for (unsigned char c : piece) mapped += byte_map().to_char[c];
    std::vector<std::int64_t> out;
    if (auto whole = vocab_.find(mapped); ignore_merges_ && whole != vocab_.end()) {
      out.push_back(whole->second);
    } else {
      std::vector<std::string> sym = chars(mapped);
      while (sym.size() > 1) {  // merge the best-ranked pair, leftmost first
        std::int64_t best = LLONG_MAX;
        std::size_t at = 0;
        for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
          auto r = ranks_.find(sym[i] + '\x01' + sym[i + 1]);
          if (r != ranks_.end() && r->second < best) best = r->second, at = i;
        }
        if (best == LLONG_MAX) break;
        sym[at] += sym[at + 1];
        sym.erase(sym.begin() + static_cast<long>(at) + 1);
      }
      for (const auto& t : sym) {
        auto it = vocab_.find(t);
        if (it == vocab_.end()) throw Error("tokenizer " + path_ + ": '" + t + "' is not in the vocabulary");
        out.push_back(it->second);
      }
    }
    ids.insert(ids.end(), out.begin(), out.end());
    std::lock_guard<std::mutex> lock(mu_);
    cache_.emplace(piece, std::move(out));
  }

  std::string path_;
  std::unordered_map<std::string, std::int64_t> vocab_, ranks_;
  std::unordered_map<std::int64_t, std::string> by_id_, added_ids_;
  std::vector<std::pair<std::string, std::int64_t>> added_;
  std::vector<std::unique_ptr<Regex>> splits_;
  bool nfc_ = false, byte_level_ = false, prefix_space_ = false, ignore_merges_ = false;
  std::int64_t max_id_ = -1;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::vector<std::int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer(const std::vector<std::string>& specials) {
  return std::make_unique<Bytes>(specials);
}
std::unique_ptr<Tokenizer> bpe_tokenizer(const std::string& path) { return std::make_unique<Bpe>(path); }

}  // namespace wick::text
