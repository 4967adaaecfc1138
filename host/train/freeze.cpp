#include "train/freeze.hpp"

#include <map>
#include <mutex>
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

namespace {

// Models being trained, and the parameters their trainers' optimizers hold.
std::mutex g_trained_mu;
std::map<const torch::nn::Module*, std::map<const void*, std::set<const c10::TensorImpl*>>> g_trained;

void refuse_untrained(const torch::nn::Module& m, const std::vector<std::string>& patterns, const std::string& fn) {
  std::lock_guard<std::mutex> lock(g_trained_mu);
  const auto it = g_trained.find(&m);
  if (it == g_trained.end()) return;
  std::vector<std::string> outside;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    if (p.value().requires_grad() || !p.value().is_floating_point()) continue;
    bool hit = false;
    for (const auto& pattern : patterns) hit = hit || names_parameter(pattern, p.key());
    if (!hit) continue;
    for (const auto& [trainer, held] : it->second)
      if (!held.count(p.value().unsafeGetTensorImpl())) {
        outside.push_back(p.key());
        break;
      }
  }
  if (outside.empty()) return;
  throw Error(fn + ": '" + outside.front() + "'" +
              (outside.size() > 1 ? " and " + std::to_string(outside.size() - 1) + " more" : std::string()) +
              " would train, but the model is being trained by a trainer whose optimizer was made without them "
              "(they were frozen then): they would report themselves trainable and never change; unfreeze before "
              "wick.train or wick.trainer, or train them in a run of their own afterwards");
}

}  // namespace

TrainedParameters::TrainedParameters(const torch::nn::Module& m, const std::vector<at::Tensor>& params) : m_(&m) {
  std::set<const c10::TensorImpl*> held;
  for (const auto& p : params) held.insert(p.unsafeGetTensorImpl());
  std::lock_guard<std::mutex> lock(g_trained_mu);
  g_trained[m_][this] = std::move(held);
}

TrainedParameters::~TrainedParameters() {
  std::lock_guard<std::mutex> lock(g_trained_mu);
  auto it = g_trained.find(m_);
  if (it == g_trained.end()) return;
  it->second.erase(this);
  if (it->second.empty()) g_trained.erase(it);
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
  if (trainable) refuse_untrained(m, patterns, fn);
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
