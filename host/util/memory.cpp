#include "util/memory.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <algorithm>
#include <array>
#include <map>
#include <unordered_map>
#include <vector>

#include "wick/options.hpp"

namespace wick {
namespace {

// The cap stands for a GPU's memory, whose collectives (NCCL) keep their
// buffers outside the caching allocator: gloo's temporaries, made on its
// worker threads or in a CollectiveAllocations scope, are counted but never
// refused. A rank refused one inside a
// collective would leave the others waiting on it; refused in its own
// compute, it can finish the collectives with them (see dist/reducer.hpp).
thread_local int uncapped_depth = 0;

bool collective_thread() {
  if (uncapped_depth > 0) return true;
  thread_local const bool gloo = [] {
    char name[32] = {};
    return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && std::strcmp(name, "pt_gloo_runloop") == 0;
  }();
  return gloo;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(std::size_t n) override {
    const auto bytes = static_cast<std::int64_t>(n);
    const std::int64_t now = allocated_.fetch_add(bytes) + bytes;
    const std::int64_t cap = limit_.load();
    if (cap > 0 && now > cap && !collective_thread()) {
      allocated_.fetch_sub(bytes);
      failures_.fetch_add(1);
      // Thrown without a C++ backtrace (what() is the message alone): code
      // that reports e.what() of a failed plugin build shows one line.
      throw c10::OutOfMemoryError("CPU out of memory: tensors would hold " + format(now) + " (" +
                                  format(now - bytes) + " held + " + format(bytes) + " more), over the cap of " +
                                  format(cap) + " (WICK_CPU_MEMORY_LIMIT or core.set_memory_limit)");
    }
    std::int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (...) {
      allocated_.fetch_sub(bytes);
      throw;
    }
    // A "simple" pointer (context == data, one raw deleter), as LibTorch's own
    // CPU allocator gives: code that calls raw_allocate() needs that. The
    // size and the inner deleter are looked up by address when it is freed.
    void* data = inner.get();
    const c10::Device device = inner.device();
    const c10::DeleterFnPtr inner_deleter = inner.get_deleter();
    if (!data) return inner;  // nothing was allocated (0 bytes)
    void* ctx = inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      Block& b = blocks_[data] = Block{ctx, inner_deleter, bytes};
      if (trace_) {
        b.frames = static_cast<int>(::backtrace(b.stack.data(), static_cast<int>(b.stack.size())));
        if (now >= snap_peak_ + (1 << 20)) snapshot(now);
      }
    }
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  CpuTensorMemory stats() const {
    return {allocated_.load(), peak_.load(), limit_.load(), failures_.load()};
  }
  void reset_peak() {
    peak_.store(allocated_.load());
    std::lock_guard<std::mutex> lock(mu_);
    snap_peak_ = 0;
  }
  void set_limit(std::int64_t bytes) { limit_.store(bytes); }

 private:
  struct Block {
    void* ctx;
    c10::DeleterFnPtr deleter;
    std::int64_t bytes;
    std::array<void*, 28> stack{};
    int frames = 0;
  };
  // WICK_MEMORY_PEAK_TRACE: the live blocks at the peak (within 1 MiB), by
  // where they were allocated, printed at exit: where a step's memory goes.
  bool trace_ = [] {
    const char* v = std::getenv("WICK_MEMORY_PEAK_TRACE");
    return v && std::strcmp(v, "1") == 0;  // other values: the CLI refuses them
  }();
  std::int64_t snap_peak_ = 0;
  std::vector<Block> snap_;
  void snapshot(std::int64_t now) {
    snap_peak_ = now;
    snap_.clear();
    for (const auto& [p, b] : blocks_) snap_.push_back(b);
  }

 public:
  void report_trace() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!trace_ || snap_.empty()) return;
    std::map<std::string, std::pair<std::int64_t, int>> by_site;
    for (const auto& b : snap_) {
      std::string site;
      int shown = 0;
      for (int i = 1; i < b.frames && shown < 6; ++i) {
        Dl_info info{};
        std::string name = "?";
        if (dladdr(b.stack[i], &info) && info.dli_sname) {
          int st = 0;
          char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &st);
          name = st == 0 && d ? d : info.dli_sname;
          std::free(d);
        } else if (info.dli_fname) {
          // a hidden symbol (a plugin's): its library and offset, for addr2line
          char off[32];
          std::snprintf(off, sizeof off, "+0x%zx",
                        static_cast<std::size_t>(static_cast<char*>(b.stack[i]) - static_cast<char*>(info.dli_fbase)));
          const char* base = std::strrchr(info.dli_fname, '/');
          name = std::string("?") + (base ? base + 1 : info.dli_fname) + off;
        }
        // the first frame outside LibTorch's dispatch and kernels, then its callers
        const bool lib = name == "?" || name.rfind("?lib", 0) == 0 || name.rfind("at::", 0) == 0 || name.rfind("c10::", 0) == 0 ||
                         name.rfind("std::", 0) == 0 || name.rfind("wick::(anonymous namespace)::Counting", 0) == 0;
        if (shown == 0 && lib) continue;
        if (name.size() > 120) name = name.substr(0, 120);
        site += "\n      " + name;
        ++shown;
      }
      auto& e = by_site[site];
      e.first += b.bytes;
      e.second += 1;
    }
    std::vector<std::pair<std::int64_t, std::pair<int, std::string>>> rows;
    for (const auto& [site, e] : by_site) rows.push_back({e.first, {e.second, site}});
    std::sort(rows.rbegin(), rows.rend());
    std::fprintf(stderr, "wick: memory peak trace: %s held at the peak\n", format(snap_peak_).c_str());
    for (std::size_t i = 0; i < rows.size() && i < 25; ++i)
      std::fprintf(stderr, "  %s in %d block(s)%s\n", format(rows[i].first).c_str(), rows[i].second.first,
                   rows[i].second.second.c_str());
  }

 private:
  static void release(void* p);

  // Bytes as a person reads them: 96 B, 3.0 KiB, 1.50 MiB, 8.00 GiB (small
  // caps and requests stay visible instead of rounding to 0.00 MiB).
  static std::string format(std::int64_t b) {
    char buf[48];
    if (b >= (1LL << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1LL << 30));
    else if (b >= (1LL << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1LL << 20));
    else if (b >= (1LL << 10)) std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / (1LL << 10));
    else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
    return buf;
  }

  c10::Allocator* inner_;
  std::atomic<std::int64_t> allocated_{0}, peak_{0}, limit_{0}, failures_{0};
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
};

CountingAllocator* g_alloc = nullptr;

void CountingAllocator::release(void* p) {
  if (!p) return;
  CountingAllocator* self = g_alloc;
  Block b{};
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->blocks_.find(p);
    if (it == self->blocks_.end()) return;  // not ours: cannot happen, never free blindly
    b = it->second;
    self->blocks_.erase(it);
  }
  self->allocated_.fetch_sub(b.bytes);
  if (b.deleter) b.deleter(b.ctx);
}



struct Installer {
  Installer() {
    install_memory_tracking();
    if (const char* v = std::getenv("WICK_CPU_MEMORY_LIMIT"); v && *v) {
      try {
        set_cpu_memory_limit(parse_bytes(v, "WICK_CPU_MEMORY_LIMIT"));
      } catch (const std::exception&) {
        // reported when the CLI starts (it parses the variable again)
      }
    }
  }
} g_installer;

}  // namespace

void install_memory_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    // never freed: tensors may outlive every other static
    g_alloc = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_alloc, /*priority=*/100);
  });
}

namespace {
std::atomic<std::int64_t> g_offload_held{0}, g_offload_peak{0};
}  // namespace

HostOffloadMemory host_offload_memory() { return {g_offload_held.load(), g_offload_peak.load()}; }
void reset_host_offload_peak() { g_offload_peak.store(g_offload_held.load()); }
void count_host_offload(std::int64_t bytes) {
  const std::int64_t now = g_offload_held.fetch_add(bytes) + bytes;
  std::int64_t p = g_offload_peak.load();
  while (now > p && !g_offload_peak.compare_exchange_weak(p, now)) {
  }
}
void* alloc_host_offload(std::size_t bytes) {
  // 64-byte aligned, as LibTorch's CPU allocator aligns
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p) count_host_offload(static_cast<std::int64_t>(bytes));
  return p;
}
void free_host_offload(void* p, std::size_t bytes) {
  if (!p) return;
  std::free(p);
  count_host_offload(-static_cast<std::int64_t>(bytes));
}

void report_memory_trace() {
  if (g_alloc) g_alloc->report_trace();
}
CpuTensorMemory cpu_tensor_memory() { return g_alloc ? g_alloc->stats() : CpuTensorMemory{}; }
void reset_cpu_tensor_peak() {
  if (g_alloc) g_alloc->reset_peak();
}
void set_cpu_memory_limit(std::int64_t bytes) {
  if (bytes < 0) throw Error("a memory limit must be >= 0 bytes, got " + std::to_string(bytes));
  install_memory_tracking();
  g_alloc->set_limit(bytes);
}

std::int64_t parse_bytes(const std::string& text, const std::string& what, bool need_unit) {
  const char* s = text.c_str();
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  std::string unit(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb") mult = 1e3;
  else if (unit == "m" || unit == "mb") mult = 1e6;
  else if (unit == "g" || unit == "gb") mult = 1e9;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  // a plain decimal number: strtod alone would also take " 1", "0x10", "inf" and "nan"
  const bool plain = end != s && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.') &&
                     std::string(s, static_cast<std::size_t>(end - s)).find_first_of("xXpP") == std::string::npos;
  if (!plain || mult == 0 || !std::isfinite(v) || v < 0)
    throw Error(what + ": expected a size such as 8GiB, 512MiB, 2GB or a number of bytes, got '" + text + "'");
  if (need_unit && unit.empty() && plain)
    throw Error(what + ": '" + text + "' has no unit: expected a size such as " + text + "GiB or " + text +
                "GB (or " + text + "B for bytes)");
  // beyond what an int64 holds (1e30) would wrap to a negative size
  if (v * mult >= 9.2e18)
    throw Error(what + ": expected a size below 8 EiB, got '" + text + "'");
  return static_cast<std::int64_t>(v * mult);
}

CollectiveAllocations::CollectiveAllocations() { ++uncapped_depth; }
CollectiveAllocations::~CollectiveAllocations() { --uncapped_depth; }

}  // namespace wick
