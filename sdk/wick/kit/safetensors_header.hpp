#pragma once
/// \file safetensors_header.hpp
/// The safetensors header, parsed and checked as the reference library
/// checks it (safetensors' Metadata::validate), without LibTorch: an 8-byte
/// little-endian length, then a JSON object of tensors {dtype, shape,
/// data_offsets} and an optional "__metadata__" of strings. A header is
/// refused when a field has the wrong type, a name is given twice, a shape's
/// element count or byte size overflows, a tensor's bytes disagree with its
/// shape and dtype, or the tensors do not tile the data back to back from
/// byte 0 to the end of the file. Errors name the file and the tensor or key.

#include <nlohmann/json.hpp>

#include <filesystem>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "wick/kit/json_fields.hpp"
#include "wick/options.hpp"

namespace wick::safetensors {

/// The reference library's limit on the header's length.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// One tensor of the header; begin and end are relative to the data start.
struct Entry {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;                  // by data offset
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::uint64_t data_start = 0;                 // 8 + the header's length
};

/// Bytes per element of a dtype wick reads, or 0 for one it does not.
inline std::uint64_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, std::uint64_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

namespace detail {

inline std::string json_text(const nlohmann::json& v) { return json_brief(v); }

// A non-negative JSON integer (not 2.0, not "2"), or false.
inline bool as_count(const nlohmann::json& v, std::uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    return true;
  }
  return false;
}

// The error for a header that breaks a rule, naming the file.
struct Corrupt {
  const std::string& file;
  Error operator()(const std::string& why) const { return Error("corrupt safetensors file " + file + ": " + why); }
};

// The header's JSON object; a tensor named twice is refused (nlohmann would
// silently keep one of the two).
inline nlohmann::json parse_object(std::string_view text, const Corrupt& corrupt) {
  // JSON text ends at a NUL for nlohmann's parser but not for the reference's
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    throw corrupt("header holds a NUL byte at offset " + std::to_string(nul) +
                  ", expected JSON text (padded with spaces, if at all)");
  std::string duplicate;
  std::set<std::string> seen;
  nlohmann::json j;
  try {
    // a name given twice would silently keep one of the two: note it while parsing
    j = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty() &&
          !seen.insert(parsed.get<std::string>()).second)
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw corrupt("header is not valid JSON (" + json_error_text(e) + ")");
  }
  if (!j.is_object()) throw corrupt("header is a JSON " + std::string(j.type_name()) + ", expected an object of tensors");
  if (!duplicate.empty()) throw corrupt("tensor '" + printable_utf8(duplicate) + "' is named twice in the header, expected unique names");
  return j;
}

// "__metadata__": null, or an object of strings.
inline void read_metadata(const nlohmann::json& m, Header& h, const Corrupt& corrupt) {
  if (m.is_null()) return;  // as the reference reads it
  if (!m.is_object()) throw corrupt("__metadata__ is " + json_text(m) + ", expected an object of strings");
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (!it->is_string())
      throw corrupt("__metadata__ key '" + printable_utf8(it.key()) + "' is " + json_text(*it) + ", expected a string");
    h.metadata[it.key()] = it->get<std::string>();
  }
}

// e's shape from `shape`, and the bytes it holds of `elem`-byte elements:
// the element count checked as the reference checks it (in order), and the
// product of the non-zero sizes, which LibTorch's strides must hold.
inline std::uint64_t read_shape(const nlohmann::json& shape, std::uint64_t elem, Entry& e, const std::string& where,
                                const Corrupt& corrupt) {
  if (!shape.is_array()) throw corrupt(where + ": shape is " + json_text(shape) + ", expected a list of integers");
  std::uint64_t numel = 1, strides = 1;
  bool overflow = false;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::uint64_t d = 0;
    if (!as_count(shape[i], d) || d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw corrupt(where + ": shape[" + std::to_string(i) + "] is " + json_text(shape[i]) +
                    ", expected a non-negative integer");
    e.shape.push_back(static_cast<std::int64_t>(d));
    if (!overflow && __builtin_mul_overflow(numel, d, &numel)) overflow = true;
    if (d && !overflow && __builtin_mul_overflow(strides, d, &strides)) overflow = true;
  }
  std::uint64_t bytes = 0;
  if (overflow || __builtin_mul_overflow(numel, elem, &bytes) ||
      strides > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / elem)
    throw corrupt(where + ": shape " + json_text(shape) + " of " + e.dtype +
                  " holds more bytes than 64 bits can count, expected a shape that fits in memory");
  return bytes;
}

// One tensor's {dtype, shape, data_offsets}.
inline Entry read_entry(const std::string& name, const nlohmann::json& t, const Corrupt& corrupt) {
  const std::string where = "tensor '" + printable_utf8(name) + "'";
  if (!t.is_object()) throw corrupt(where + " is " + json_text(t) + ", expected an object {dtype, shape, data_offsets}");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!t.contains(key)) throw corrupt(where + " lacks " + key + ", expected dtype, shape and data_offsets");
  Entry e;
  e.name = name;
  if (!t["dtype"].is_string())
    throw corrupt(where + ": dtype is " + json_text(t["dtype"]) + ", expected a string such as \"F32\"");
  e.dtype = t["dtype"].get<std::string>();
  const std::uint64_t elem = dtype_size(e.dtype);
  if (!elem)
    throw corrupt(where + " has unsupported dtype " + e.dtype +
                  ", expected F64, F32, F16, BF16, I64, I32, I16, I8, U8 or BOOL");
  const auto& shape = t["shape"];
  const std::uint64_t bytes = read_shape(shape, elem, e, where, corrupt);
  const auto& offs = t["data_offsets"];
  if (!offs.is_array() || offs.size() != 2 || !as_count(offs[0], e.begin) || !as_count(offs[1], e.end))
    throw corrupt(where + ": data_offsets is " + json_text(offs) + ", expected two non-negative integers [begin, end]");
  if (e.end < e.begin)
    throw corrupt(where + ": data_offsets " + json_text(offs) + " end before they begin, expected begin <= end");
  if (e.end - e.begin != bytes)
    throw corrupt(where + " has " + std::to_string(e.end - e.begin) + " bytes (data_offsets " + json_text(offs) +
                  "), its shape " + json_text(shape) + " and dtype " + e.dtype + " need " + std::to_string(bytes));
  return e;
}

// Sorts the entries by offset and checks they lie back to back from byte 0:
// no gap, no overlap, nothing after the last.
inline void check_tiling(std::vector<Entry>& entries, std::uint64_t data_size, const Corrupt& corrupt) {
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name); });
  std::uint64_t at = 0;
  const Entry* before = nullptr;
  for (const auto& e : entries) {
    if (e.begin != at)
      throw corrupt("tensor '" + printable_utf8(e.name) + "': data_offsets begin at byte " + std::to_string(e.begin) +
                    ", expected " + std::to_string(at) + (before ? " where '" + printable_utf8(before->name) + "' ends" : std::string(", the data's start")) +
                    " (tensors lie back to back, without gaps or overlaps)");
    at = e.end;
    before = &e;
  }
  if (at > data_size)
    throw corrupt((before ? "tensor '" + printable_utf8(before->name) + "' ends at data byte " : std::string("data end at byte ")) +
                  std::to_string(at) + ", outside the file's " + std::to_string(data_size) + " data bytes");
  if (at < data_size)
    throw corrupt("the tensors cover " + std::to_string(at) + " of the file's " + std::to_string(data_size) +
                  " data bytes, expected the data to end where the last tensor ends");
}

}  // namespace detail

/// Parses and checks the header's JSON text; `data_size` is the number of
/// bytes after the header. `file` names the file in errors.
inline Header parse_header(std::string_view text, std::uint64_t data_size, const std::string& file) {
  const detail::Corrupt corrupt{file};
  const nlohmann::json j = detail::parse_object(text, corrupt);
  Header h;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      detail::read_metadata(*it, h, corrupt);
    } else {
      h.entries.push_back(detail::read_entry(it.key(), *it, corrupt));
    }
  }
  detail::check_tiling(h.entries, data_size, corrupt);
  return h;
}

/// The header's length from the file's first 8 bytes, checked against the
/// file's size and the reference's limit.
inline std::uint64_t header_length(const unsigned char first8[8], std::uint64_t file_size, const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n > kMaxHeaderBytes || n > file_size - 8)
    throw Error("corrupt safetensors file " + file + ": header length " + std::to_string(n) + " exceeds the file size " +
                std::to_string(file_size) + (n > kMaxHeaderBytes ? " (and the 100 MB limit)" : "") +
                ", expected the 8-byte length of the JSON header that follows it");
  return n;
}

/// `file` as a message names it: with the file a link leads to, when it is one
/// (a model folder's model.safetensors linked to the wrong file).
inline std::string named_file(const std::string& file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(file, ec))) return printable_utf8(file);
  fs::path target = fs::canonical(file, ec);
  if (ec) target = fs::read_symlink(file, ec);
  return printable_utf8(file) + " (a link to " + printable_utf8(target.string()) + ")";
}

/// A whole file's bytes (or at least its first 8 + header length bytes, with
/// `file_size` the whole size): its header.
inline Header parse(std::string_view bytes, std::uint64_t file_size, const std::string& file) {
  if (file_size < 8 || bytes.size() < 8)
    throw Error("corrupt safetensors file " + file + ": shorter than its 8-byte header length, expected a safetensors file");
  {
    // Another kind of file (text, a pickle, a link to the wrong file): its
    // first 8 bytes give a length beyond the file and no JSON object follows
    // them. It is said to be no safetensors file, not a damaged one, and its
    // bytes are not echoed as a length. (A real header is a JSON object: '{',
    // perhaps after spaces.)
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
    const auto start = bytes.substr(0, 8 + 4096).find_first_not_of(" \t\n\r", 8);
    const bool json_follows = start != std::string_view::npos && bytes[start] == '{';
    if ((n > kMaxHeaderBytes || n > file_size - 8) && !json_follows)
      throw Error(named_file(file) + " is not a safetensors file: it does not start with the 8-byte length of a JSON "
                  "header that fits in its " + std::to_string(file_size) +
                  " bytes, expected a safetensors file (an 8-byte little-endian length, a JSON header, the tensors' bytes)");
  }
  const std::uint64_t n = header_length(reinterpret_cast<const unsigned char*>(bytes.data()), file_size, file);
  if (bytes.size() < 8 + n)
    throw Error("corrupt safetensors file " + file + ": cut short inside its header, expected " + std::to_string(n) +
                " header bytes");
  Header h = parse_header(bytes.substr(8, n), file_size - 8 - n, file);
  h.data_start = 8 + n;
  return h;
}

/// The shards a model.safetensors.index.json names (the values of its
/// weight_map), each a relative path that stays inside `dir` and exists.
/// `index` is the parsed file; `who` starts each message.
inline std::vector<std::filesystem::path> index_shards(const nlohmann::json& index, const std::filesystem::path& dir,
                                                       const std::string& who) {
  namespace fs = std::filesystem;
  const std::string file = (dir / "model.safetensors.index.json").string();
  const JsonFields j(index, who + ": " + file);
  const JsonFields map = j.object("weight_map");
  std::set<std::string> names;
  std::vector<fs::path> out;
  for (auto it = map.json().begin(); it != map.json().end(); ++it) {
    if (!it->is_string()) map.bad(it.key(), "the name of a .safetensors file in the folder");
    const std::string shard = it->get<std::string>();
    const fs::path rel(shard);
    const fs::path norm = rel.lexically_normal();
    // files named by an index stay inside the model folder (no "/...", no "../")
    if (shard.empty() || rel.is_absolute() || rel.has_root_name() || norm.empty() || *norm.begin() == ".." ||
        norm == ".")
      map.fail(it.key(), "names the shard " + json_brief(*it) +
                             ", expected a file inside the model folder (a relative path without ../)");
    if (!names.insert(norm.string()).second) continue;
    std::error_code ec;
    if (!fs::is_regular_file(dir / norm, ec))
      map.fail(it.key(), "is in the shard " + json_brief(*it) + ", which " +
                             (fs::exists(dir / norm, ec) ? "is not a file" : "does not exist") + " in " + dir.string() +
                             ", expected every shard the index names beside it");
    out.push_back(dir / norm);
  }
  if (out.empty()) j.bad("weight_map", "an object naming at least one tensor's shard");
  return out;
}

/// The weight files of a Hugging Face folder: model.safetensors, or the
/// shards of model.safetensors.index.json.
inline std::vector<std::filesystem::path> folder_files(const std::filesystem::path& dir, const std::string& who) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(who + ": " + dir.string() + (fs::exists(dir, ec) ? " is not a folder" : " does not exist") +
                ", expected a Hugging Face model folder");
  if (fs::exists(dir / "model.safetensors", ec)) return {dir / "model.safetensors"};
  if (fs::exists(dir / "model.safetensors.index.json", ec))
    return index_shards(read_json_file(dir / "model.safetensors.index.json"), dir, who);
  throw Error(who + ": " + dir.string() + " has no model.safetensors or model.safetensors.index.json");
}

}  // namespace wick::safetensors
