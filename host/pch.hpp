// Precompiled for the host library: the LibTorch and library headers every
// host file needs. Narrow ATen headers, never torch/torch.h.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>
