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

#include "wick/kit/safetensors_header.hpp"
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

/// The tensors of a Hugging Face folder: model.safetensors, or the shards of
/// model.safetensors.index.json (each inside the folder), in shard order. A
/// name in two shards is an error; `who` starts each message.
inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors_folder(const std::filesystem::path& dir,
                                                                               const std::string& who);

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
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec))
    throw Error("safetensors file " + file.string() + " is a directory, expected a .safetensors file");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot open safetensors file " + file.string() + ": " + std::strerror(errno));
  const auto file_size = std::filesystem::file_size(file, ec);
  if (ec) throw Error("cannot read safetensors file " + file.string() + ": " + ec.message());
  // the 8-byte length, then the header it gives (checked as the reference checks it)
  std::string head(8, '\0');
  in.read(head.data(), 8);
  if (in && file_size >= 8) {
    const std::uint64_t n =
        safetensors::header_length(reinterpret_cast<const unsigned char*>(head.data()), file_size, file.string());
    head.resize(8 + n);
    in.read(head.data() + 8, static_cast<std::streamsize>(n));
  }
  const safetensors::Header header = safetensors::parse(head, file_size, file.string());
  TensorFile out;
  out.metadata = header.metadata;
  for (const auto& e : header.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(detail::dtype_by_name().at(e.dtype)));
    in.seekg(static_cast<std::streamoff>(header.data_start + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    if (!in)
      throw Error("corrupt safetensors file " + file.string() + ": tensor '" + e.name + "' is cut short, expected " +
                  std::to_string(e.end - e.begin) + " bytes");
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

inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors_folder(const std::filesystem::path& dir,
                                                                               const std::string& who) {
  std::vector<std::pair<std::string, at::Tensor>> all;
  std::map<std::string, std::string> from;  // tensor -> its file
  for (const auto& f : safetensors::folder_files(dir, who))
    for (auto& t : read_safetensors(f).tensors) {
      auto [it, fresh] = from.emplace(t.first, f.string());
      if (!fresh)
        throw Error(who + ": tensor '" + t.first + "' is in both " + it->second + " and " + f.string() +
                    ", expected each tensor in one shard");
      all.push_back(std::move(t));
    }
  return all;
}

}  // namespace wick
