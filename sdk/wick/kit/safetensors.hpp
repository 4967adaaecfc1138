#pragma once
/// \file safetensors.hpp
/// safetensors read and write (the reference format: 8-byte little-endian
/// header length, JSON header, raw little-endian data). Writes are atomic.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "wick/options.hpp"

namespace wick {

struct TensorFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // file order
  std::map<std::string, std::string> metadata;              // "__metadata__"
  const at::Tensor* get(const std::string& name) const {
    for (const auto& [n, t] : tensors)
      if (n == name) return &t;
    return nullptr;
  }
};

/// Reads a whole file into CPU tensors; errors name the file and the problem.
inline TensorFile read_safetensors(const std::filesystem::path& file);

/// Writes tensors (moved to CPU, made contiguous) to `file` through a
/// temporary file and rename, so a reader never sees half a file.
inline void write_safetensors(const std::filesystem::path& file,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Writes `bytes` to `file` atomically (temporary file, fsync, rename).
inline void write_file_atomic(const std::filesystem::path& file, const std::string& bytes);


namespace detail {

inline const std::map<std::string, at::ScalarType>& dtype_by_name() {
  static const std::map<std::string, at::ScalarType> m = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return m;
}

inline std::string dtype_name(at::ScalarType t) {
  for (const auto& [n, s] : dtype_by_name())
    if (s == t) return n;
  throw Error(std::string("safetensors cannot store dtype ") + c10::toString(t));
}

inline void fsync_path(const std::filesystem::path& p, bool dir) {
  int fd = ::open(p.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace detail

inline void write_file_atomic(const std::filesystem::path& file, const std::string& bytes) {
  const std::filesystem::path dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::random_device rd;
  const std::filesystem::path tmp = dir / ("." + file.filename().string() + ".tmp" + std::to_string(rd()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("cannot write " + tmp.string() + ": " + std::strerror(errno));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      throw Error("cannot write " + file.string() + ": " + std::strerror(errno));
    }
  }
  detail::fsync_path(tmp, false);
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw Error("cannot write " + file.string() + ": " + ec.message());
  }
  detail::fsync_path(dir, true);
}

inline TensorFile read_safetensors(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot open safetensors file " + file.string() + ": " + std::strerror(errno));
  std::error_code ec;
  const auto file_size = std::filesystem::file_size(file, ec);
  auto corrupt = [&](const std::string& why) {
    return Error("corrupt safetensors file " + file.string() + ": " + why);
  };
  if (ec || file_size < 8) throw corrupt("shorter than its 8-byte header length");
  std::uint64_t header_len = 0;
  unsigned char lenbuf[8];
  in.read(reinterpret_cast<char*>(lenbuf), 8);
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | lenbuf[i];
  if (header_len > file_size - 8 || header_len > (100u << 20))
    throw corrupt("header length " + std::to_string(header_len) + " exceeds the file size " +
                  std::to_string(file_size));
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    throw corrupt(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw corrupt("header is not a JSON object");
  const std::uint64_t data_start = 8 + header_len;
  const std::uint64_t data_size = file_size - data_start;
  TensorFile out;
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) throw corrupt("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) throw corrupt("__metadata__ value '" + m.key() + "' is not a string");
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const auto& t = *it;
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
      throw corrupt("tensor '" + it.key() + "' lacks dtype, shape or data_offsets");
    Entry e;
    e.name = it.key();
    const auto dt = t["dtype"].get<std::string>();
    auto found = detail::dtype_by_name().find(dt);
    if (found == detail::dtype_by_name().end()) throw corrupt("tensor '" + e.name + "' has unsupported dtype " + dt);
    e.dtype = found->second;
    e.shape = t["shape"].get<std::vector<std::int64_t>>();
    auto offs = t["data_offsets"].get<std::vector<std::uint64_t>>();
    if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size)
      throw corrupt("tensor '" + e.name + "' data offsets lie outside the file");
    e.begin = offs[0];
    e.end = offs[1];
    std::uint64_t numel = 1;
    for (auto d : e.shape) {
      if (d < 0) throw corrupt("tensor '" + e.name + "' has a negative dimension");
      numel *= static_cast<std::uint64_t>(d);
    }
    if (numel * c10::elementSize(e.dtype) != e.end - e.begin)
      throw corrupt("tensor '" + e.name + "' has " + std::to_string(e.end - e.begin) +
                    " bytes, its shape and dtype need " + std::to_string(numel * c10::elementSize(e.dtype)));
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    if (!in) throw corrupt("tensor '" + e.name + "' is cut short");
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

inline void write_safetensors(const std::filesystem::path& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  std::uint64_t offset = 0;
  for (const auto& [name, t0] : tensors) {
    at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    const std::uint64_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", detail::dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h.push_back(' ');  // data starts 8-byte aligned, as the reference writer does
  std::string bytes;
  bytes.reserve(8 + h.size() + offset);
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((h.size() >> (8 * i)) & 0xff));
  bytes += h;
  for (const auto& t : data)
    bytes.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  write_file_atomic(file, bytes);
}

}  // namespace wick
