#pragma once
/// \file safetensors.hpp
/// safetensors read and write (the reference format: 8-byte little-endian
/// header length, JSON header, raw little-endian data). Reads map the file:
/// each tensor is a view over the mapping (copy-on-write, never written back),
/// and when the last tensor over some pages is freed those pages leave the
/// process's resident set, so copying a file's tensors into a model and
/// dropping them holds the file at most once. Writes stream tensor by tensor
/// to a temporary file renamed over the target: atomic, and never the whole
/// file in one buffer.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
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

/// Reads a file's tensors as CPU tensors viewing a private mapping of it
/// (writing into one changes neither the file nor the others); a tensor whose
/// bytes are not aligned to its element size is copied instead. Freeing a
/// tensor releases its pages (see the file's note). The file must not be
/// truncated while its tensors live. Errors name the file and the problem.
inline TensorFile read_safetensors(const std::filesystem::path& file);

/// The tensors of a Hugging Face folder: model.safetensors, or the shards of
/// model.safetensors.index.json (each inside the folder), in shard order. A
/// name in two shards is an error; `who` starts each message.
inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors_folder(const std::filesystem::path& dir,
                                                                               const std::string& who);

/// Writes tensors (each moved to CPU and made contiguous in turn, while it is
/// written) to `file` through a temporary file and rename, so a reader never
/// sees half a file.
inline void write_safetensors(const std::filesystem::path& file,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// A tensor write_safetensors makes only when its turn comes: its name,
/// dtype and shape (for the header), and what gives its values. Tensors
/// derived from a model (dequantized, merged) then exist one at a time.
struct LazyTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::function<at::Tensor()> make;
};

/// The same from lazily made tensors; a made tensor of another dtype or
/// shape than declared is an error naming it.
inline void write_safetensors(const std::filesystem::path& file, const std::vector<LazyTensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

/// Puts one declared tensor's values into a file being written.
using PutTensor = std::function<void(const std::string& name, const at::Tensor& values)>;

/// The same, with the tensors arriving in any order: `tensors` declare them
/// (name, dtype, shape; `make` unused), and `produce(put)` calls put once for
/// each, in whatever order it makes them (a divided model's units as they
/// are gathered, a deferred model's values as they are made), so only the
/// tensor being put exists. A tensor put twice, not declared, of another
/// dtype or shape than declared, or never put, is an error naming it, and the
/// file is left as it was.
inline void write_safetensors_placed(const std::filesystem::path& file, const std::vector<LazyTensor>& tensors,
                                     const std::function<void(const PutTensor&)>& produce,
                                     const std::map<std::string, std::string>& metadata = {});

/// Writes `bytes` to `file` atomically (temporary file, fsync, rename).
inline void write_file_atomic(const std::filesystem::path& file, const std::string& bytes);

/// Writes `file` atomically from `fill`, which streams the content into the
/// temporary file; if it throws, the temporary file is removed and `file`
/// is left as it was.
inline void write_file_atomic(const std::filesystem::path& file, const std::function<void(std::ostream&)>& fill);


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

inline void write_file_atomic(const std::filesystem::path& file, const std::function<void(std::ostream&)>& fill) {
  const std::filesystem::path dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec))  // rename would fail after the whole file was written
    throw Error("cannot write " + file.string() + ": it is a folder, expected a file path (a run's `out` folder?)");
  std::filesystem::create_directories(dir, ec);
  std::random_device rd;
  const std::filesystem::path tmp = dir / ("." + file.filename().string() + ".tmp" + std::to_string(rd()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("cannot write " + tmp.string() + ": " + std::strerror(errno));
    try {
      fill(out);
    } catch (...) {
      out.close();
      std::filesystem::remove(tmp, ec);
      throw;
    }
    out.flush();
    if (!out) {
      const std::string why = std::strerror(errno);
      out.close();
      std::filesystem::remove(tmp, ec);
      throw Error("cannot write " + file.string() + ": " + why);
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

inline void write_file_atomic(const std::filesystem::path& file, const std::string& bytes) {
  write_file_atomic(file, [&](std::ostream& out) { out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

namespace detail {

// A whole file mapped privately (copy-on-write); unmapped with its last tensor.
struct Mapping {
  void* addr = MAP_FAILED;
  std::size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != MAP_FAILED) ::munmap(addr, size);
  }
};

// Drops the pages wholly inside [p, p + n) from the resident set: a private
// mapping reads them from the file again if touched later.
inline void release_pages(const void* p, std::size_t n) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto b = reinterpret_cast<std::uintptr_t>(p), e = b + n;
  const std::uintptr_t lo = (b + page - 1) / page * page, hi = e / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

// The context of one tensor's view: the mapping it keeps alive and its bytes.
struct MappedView {
  std::shared_ptr<Mapping> map;
  const char* begin;
  std::size_t bytes;
};

inline void free_view(void* ctx) {
  auto* v = static_cast<MappedView*>(ctx);
  release_pages(v->begin, v->bytes);
  delete v;
}

inline bool is_file_view(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &free_view;
}

}  // namespace detail

/// Drops from the resident set the pages wholly inside `t`'s bytes when `t`
/// is contiguous and views a file read by read_safetensors (else does
/// nothing): reading them again reads the file again. For a tensor that was
/// never written to (a write into its copy-on-write pages would be lost):
/// loaders call it on the part of a tensor they have just copied.
inline void release_file_pages(const at::Tensor& t) {
  if (!detail::is_file_view(t) || !t.is_contiguous()) return;
  detail::release_pages(t.data_ptr(), t.numel() * t.element_size());
}

inline TensorFile read_safetensors(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec))
    throw Error("safetensors file " + file.string() + " is a directory, expected a .safetensors file");
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open safetensors file " + file.string() + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("cannot read safetensors file " + file.string() + ": " + why);
  }
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  auto map = std::make_shared<detail::Mapping>();
  if (file_size >= 8) {
    // MAP_NORESERVE: the private mapping's copy-on-write pages are not charged up front
    map->addr = ::mmap(nullptr, file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    map->size = file_size;
  }
  const int map_errno = errno;
  ::close(fd);
  if (file_size >= 8 && map->addr == MAP_FAILED)
    throw Error("cannot read safetensors file " + file.string() + ": " + std::strerror(map_errno));
  const char* base = static_cast<const char*>(map->addr == MAP_FAILED ? nullptr : map->addr);
  // the 8-byte length, then the header it gives (checked as the reference checks it)
  const safetensors::Header header =
      safetensors::parse(base ? std::string_view(base, file_size) : std::string_view(), file_size, file.string());
  // the header's pages are read once: they need not stay resident
  detail::release_pages(base, header.data_start);
  TensorFile out;
  out.metadata = header.metadata;
  for (const auto& e : header.entries) {
    const auto dtype = detail::dtype_by_name().at(e.dtype);
    const auto options = at::TensorOptions().dtype(dtype);
    const char* src = base + header.data_start + e.begin;
    const std::size_t bytes = e.end - e.begin;
    at::Tensor t;
    if (bytes == 0) {
      t = at::empty(e.shape, options);
    } else if (reinterpret_cast<std::uintptr_t>(src) % safetensors::dtype_size(e.dtype) != 0) {
      // LibTorch's kernels expect elements at their natural alignment
      t = at::empty(e.shape, options);
      std::memcpy(t.data_ptr(), src, bytes);
    } else {
      auto* view = new detail::MappedView{map, src, bytes};
      t = at::for_blob(const_cast<char*>(src), e.shape)
              .options(options)
              .context(view, &detail::free_view)
              .target_device(at::kCPU)
              .make_tensor();
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

namespace detail {
// The header (its length first, then the JSON, padded so the data starts
// 8-byte aligned, as the reference writer does) and each tensor's data offset.
inline std::string safetensors_header(const std::vector<LazyTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      std::vector<std::uint64_t>* offsets) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    std::uint64_t bytes = c10::elementSize(t.dtype);
    for (auto d : t.shape) bytes *= static_cast<std::uint64_t>(d);
    header[t.name] = {{"dtype", detail::dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    if (offsets) offsets->push_back(offset);
    offset += bytes;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h.push_back(' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
  return out + h;
}

// t on the CPU and contiguous, checked against its declaration.
inline at::Tensor declared(const LazyTensor& lazy, const at::Tensor& made, const char* who) {
  const at::Tensor t = made.detach().to(at::kCPU).contiguous();
  if (t.scalar_type() != lazy.dtype || t.sizes() != at::IntArrayRef(lazy.shape))
    throw std::logic_error(std::string(who) + ": " + lazy.name + " was made " + detail::dtype_name(t.scalar_type()) +
                           " " + c10::str(t.sizes()) + ", declared " + detail::dtype_name(lazy.dtype) + " " +
                           c10::str(at::IntArrayRef(lazy.shape)));
  return t;
}
}  // namespace detail

inline void write_safetensors(const std::filesystem::path& file, const std::vector<LazyTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string head = detail::safetensors_header(tensors, metadata, nullptr);
  write_file_atomic(file, [&](std::ostream& out) {
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    // one tensor at a time: only it is made, copied to the CPU or made contiguous
    for (const auto& lazy : tensors) {
      const at::Tensor t = detail::declared(lazy, lazy.make(), "write_safetensors");
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
      if (!out) return;  // the caller reports the failed stream
    }
  });
}

inline void write_safetensors_placed(const std::filesystem::path& file, const std::vector<LazyTensor>& tensors,
                                     const std::function<void(const PutTensor&)>& produce,
                                     const std::map<std::string, std::string>& metadata) {
  std::vector<std::uint64_t> offsets;
  const std::string head = detail::safetensors_header(tensors, metadata, &offsets);
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  write_file_atomic(file, [&](std::ostream& out) {
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    std::vector<bool> put(tensors.size(), false);
    produce([&](const std::string& name, const at::Tensor& values) {
      auto it = index.find(name);
      if (it == index.end()) throw std::logic_error("write_safetensors_placed: " + name + " was not declared");
      if (put[it->second]) throw std::logic_error("write_safetensors_placed: " + name + " was put twice");
      const at::Tensor t = detail::declared(tensors[it->second], values, "write_safetensors_placed");
      out.seekp(static_cast<std::streamoff>(head.size() + offsets[it->second]));
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
      if (!out) throw Error("cannot write " + file.string() + ": " + std::strerror(errno));
      put[it->second] = true;
    });
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (!put[i]) throw std::logic_error("write_safetensors_placed: " + tensors[i].name + " was never put");
  });
}

inline void write_safetensors(const std::filesystem::path& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<LazyTensor> lazy;
  lazy.reserve(tensors.size());
  for (const auto& [name, t] : tensors) lazy.push_back({name, t.scalar_type(), t.sizes().vec(), [&t] { return t; }});
  write_safetensors(file, lazy, metadata);
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
