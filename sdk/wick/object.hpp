#pragma once
/// \file object.hpp
/// The base of everything a plugin factory makes.

#include <map>
#include <string>

#include "wick/options.hpp"

namespace wick {

/// What a factory returned; the host checks it against the plugin's kind.
enum class ObjectKind { Model, Dataset, Optimizer, Schedule, Transform };

inline const char* to_string(ObjectKind k) {
  switch (k) {
    case ObjectKind::Model: return "model";
    case ObjectKind::Dataset: return "dataset";
    case ObjectKind::Optimizer: return "optimizer";
    case ObjectKind::Schedule: return "schedule";
    case ObjectKind::Transform: return "transform";
  }
  return "?";
}

class Object {
 public:
  virtual ~Object() = default;
  virtual ObjectKind object_kind() const = 0;
  /// Optional: read-only facts a recipe may read as fields (data.num_classes).
  virtual std::map<std::string, Value> attributes() const { return {}; }
};

}  // namespace wick
