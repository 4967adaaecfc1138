#pragma once
#include <string>
#include <vector>

namespace wick {
/// `wick launch [options] RECIPE [key=value ...]`: starts the local ranks.
int launch(const std::vector<std::string>& args);
}  // namespace wick
