#pragma once
/// \file dtype_names.hpp
/// The weight dtypes a model's `dtype` option names, declared once for every
/// plugin that takes one:
/// \code
///   wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames))
///   const at::ScalarType t = wick::parse_enum(wick::kDtypeNames, o.get_string("dtype"), "dtype");
/// \endcode

#include <c10/core/ScalarType.h>

#include <string>

#include "wick/kit/enum_names.hpp"

namespace wick {

inline constexpr EnumName<c10::ScalarType> kDtypeNames[] = {
    {c10::ScalarType::Float, "fp32"}, {c10::ScalarType::BFloat16, "bf16"}, {c10::ScalarType::Half, "fp16"}};
static_assert(enum_names_distinct(kDtypeNames));

/// The same dtypes as a Hugging Face config.json names them (`torch_dtype`,
/// `dtype`): what a saved folder says and what a folder read is checked against.
inline constexpr EnumName<c10::ScalarType> kHfDtypeNames[] = {
    {c10::ScalarType::Float, "float32"}, {c10::ScalarType::BFloat16, "bfloat16"}, {c10::ScalarType::Half, "float16"}};
static_assert(enum_names_distinct(kHfDtypeNames));

/// A `dtype` option's value ("bf16") as config.json writes it ("bfloat16").
inline std::string hf_dtype_name(const std::string& dtype) {
  const auto t = find_enum(kDtypeNames, dtype);
  return std::string(enum_name(kHfDtypeNames, t ? *t : c10::ScalarType::Float));
}
/// config.json's name ("bfloat16") as a `dtype` option's value ("bf16"), or
/// "" when it names none of them.
inline std::string dtype_of_hf_name(const std::string& hf) {
  const auto t = find_enum(kHfDtypeNames, hf);
  return t ? std::string(enum_name(kDtypeNames, *t)) : std::string();
}

}  // namespace wick
