#pragma once
/// \file dtype_names.hpp
/// The weight dtypes a model's `dtype` option names, declared once for every
/// plugin that takes one:
/// \code
///   wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames))
///   const at::ScalarType t = wick::parse_enum(wick::kDtypeNames, o.get_string("dtype"), "dtype");
/// \endcode

#include <c10/core/ScalarType.h>

#include "wick/kit/enum_names.hpp"

namespace wick {

inline constexpr EnumName<c10::ScalarType> kDtypeNames[] = {
    {c10::ScalarType::Float, "fp32"}, {c10::ScalarType::BFloat16, "bf16"}, {c10::ScalarType::Half, "fp16"}};
static_assert(enum_names_distinct(kDtypeNames));

}  // namespace wick
