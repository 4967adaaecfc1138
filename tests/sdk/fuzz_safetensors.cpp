// libFuzzer target for the safetensors header parser (sdk/wick/kit/
// safetensors_header.hpp): the input is a whole file. A wick::Error is a
// clean refusal; a crash, a sanitizer report, or a header accepted although
// its tensors do not tile the data exactly is a bug.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "wick/kit/safetensors_header.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto h = wick::safetensors::parse(bytes, size, "fuzz.safetensors");
    std::uint64_t at = 0;
    for (const auto& e : h.entries) {
      std::uint64_t n = wick::safetensors::dtype_size(e.dtype);
      for (auto d : e.shape) n *= static_cast<std::uint64_t>(d);
      if (e.begin != at || e.end - e.begin != n) std::abort();
      at = e.end;
    }
    if (h.data_start + at != size) std::abort();
  } catch (const wick::Error&) {
  }
  return 0;
}
