#pragma once
/// \file hf_dtype_names.hpp
/// The weight dtypes as a `dtype` option names them ("bf16") and as a
/// Hugging Face config.json does (`torch_dtype`, `dtype`: "bfloat16"),
/// declared once for every plugin that reads or writes a config (no LibTorch
/// needed: config readers build without it).

#include <string>
#include <string_view>
#include <utility>

namespace wick {

inline constexpr std::pair<std::string_view, std::string_view> kHfDtypeNames[] = {
    {"fp32", "float32"}, {"bf16", "bfloat16"}, {"fp16", "float16"}};

/// A `dtype` option's value ("bf16") as config.json writes it ("bfloat16");
/// float32 for anything else.
inline std::string hf_dtype_name(const std::string& dtype) {
  for (const auto& [ours, hf] : kHfDtypeNames)
    if (ours == dtype) return std::string(hf);
  return "float32";
}

/// config.json's name ("bfloat16") as a `dtype` option's value ("bf16"), or
/// "" when it names none of them.
inline std::string dtype_of_hf_name(const std::string& hf) {
  for (const auto& [ours, theirs] : kHfDtypeNames)
    if (theirs == hf) return std::string(ours);
  return "";
}

}  // namespace wick
