#include "train/freeze.hpp"

#include <set>

#include "wick/object.hpp"

namespace wick {
namespace {

bool glob(const char* p, const char* s) {
  // iterative '*' backtracking: linear in practice, no recursion depth
  const char *star = nullptr, *resume = nullptr;
  while (*s) {
    if (*p == '*') {
      star = p++;
      resume = s;
    } else if (*p == '?' || *p == *s) {
      ++p;
      ++s;
    } else if (star) {
      p = star + 1;
      s = ++resume;
    } else {
      return false;
    }
  }
  while (*p == '*') ++p;
  return *p == '\0';
}

}  // namespace

bool names_parameter(const std::string& pattern, const std::string& name) {
  if (pattern.find_first_of("*?") != std::string::npos) return glob(pattern.c_str(), name.c_str());
  return name == pattern || (name.size() > pattern.size() && name.compare(0, pattern.size(), pattern) == 0 &&
                             name[pattern.size()] == '.');
}

TrainableCount set_trainable(torch::nn::Module& m, const std::vector<std::string>& patterns, bool trainable,
                             const std::string& fn) {
  if (patterns.empty()) throw Error(fn + ": expected a pattern or a list of patterns, got none");
  const auto params = m.named_parameters(/*recurse=*/true);
  // every pattern checked before anything changes: a refused call leaves the model as it was
  for (const auto& pattern : patterns) {
    bool used = false;
    for (const auto& p : params) used = used || names_parameter(pattern, p.key());
    if (used) continue;
    std::set<std::string> tops;
    for (const auto& p : params) tops.insert(p.key().substr(0, p.key().find('.')));
    std::string list;
    for (const auto& t : tops) list += (list.empty() ? "" : ", ") + t;
    throw Error(fn + ": '" + pattern + "' names no parameter of the model (expected a parameter's or a module's "
                "name, or a glob such as '*.bias'; its top-level modules: " + list + ")");
  }
  TrainableCount c;
  for (const auto& p : params) {
    bool hit = false;
    for (const auto& pattern : patterns) hit = hit || names_parameter(pattern, p.key());
    if (hit && p.value().is_floating_point()) {
      p.value().set_requires_grad(trainable);
      ++c.matched;
    }
  }
  for (const auto& p : params) {
    c.total += p.value().numel();
    if (p.value().requires_grad()) c.trainable += p.value().numel();
  }
  return c;
}

}  // namespace wick
