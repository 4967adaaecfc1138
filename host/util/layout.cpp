#include "util/layout.hpp"

#include <dlfcn.h>

#include <ATen/Parallel.h>
#include <boost/dll/runtime_symbol_info.hpp>

namespace fs = std::filesystem;

namespace wick::layout {

namespace configured {
extern const char* const kLibToData;
extern const char* const kLibDir;
}  // namespace configured

namespace {
fs::path real(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::canonical(p, ec);
  return ec ? p.lexically_normal() : r;
}
}  // namespace

fs::path library_dir() {
  static const fs::path dir = real(boost::dll::this_line_location().string()).parent_path();
  return dir;
}

fs::path plugin_dir() { return library_dir() / "wick" / "plugins"; }

fs::path data_dir() { return (library_dir() / configured::kLibToData / "wick").lexically_normal(); }

fs::path prefix() {
  fs::path p = library_dir();
  for (const auto& part : fs::path(configured::kLibDir))
    if (!part.empty() && part != ".") p = p.parent_path();
  return p;
}

fs::path libtorch_dir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || info.dli_fname == nullptr) return {};
  return real(info.dli_fname).parent_path();
}

}  // namespace wick::layout
