#include "train/freeze.hpp"

#include <regex>
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
  if (pattern.rfind("re:", 0) == 0) {
    try {
      return std::regex_match(name, std::regex(pattern.substr(3), std::regex::ECMAScript));
    } catch (const std::regex_error& e) {
      throw Error("'" + pattern + "' is not a valid regular expression: " + e.what());
    }
  }
  if (pattern.find_first_of("*?") != std::string::npos) return glob(pattern.c_str(), name.c_str());
  if (pattern.empty() || name.size() < pattern.size()) return false;
  if (name == pattern) return true;
  // whole dotted components, at any depth: a module ("model.vision_tower",
  // "q_proj") or the parameter's own name ("bias")
  for (std::size_t at = name.find(pattern); at != std::string::npos; at = name.find(pattern, at + 1)) {
    const std::size_t end = at + pattern.size();
    if ((at == 0 || name[at - 1] == '.') && (end == name.size() || name[end] == '.')) return true;
  }
  return false;
}

void check_pattern(const std::string& pattern, const std::string& where) {
  if (pattern.empty()) throw Error(where + ": an empty pattern (expected a parameter's or a module's name, a glob "
                                   "such as '*.bias' or 're:' and a regular expression)");
  if (pattern.rfind("re:", 0) == 0) {
    try {
      std::regex(pattern.substr(3), std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw Error(where + ": '" + pattern + "' is not a valid regular expression: " + e.what());
    }
  }
}

TrainableCount set_trainable(torch::nn::Module& m, const std::vector<std::string>& patterns, bool trainable,
                             const std::string& fn) {
  if (patterns.empty()) throw Error(fn + ": expected a pattern or a list of patterns, got none");
  const auto params = m.named_parameters(/*recurse=*/true);
  // every pattern checked before anything changes: a refused call leaves the model as it was
  for (const auto& pattern : patterns) {
    check_pattern(pattern, fn);
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
