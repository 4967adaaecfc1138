#include "train/run_context.hpp"

#include <algorithm>

namespace wick {

RunContext::RunContext(std::vector<Pair> args) : args_(std::move(args)) {}

std::optional<std::string> RunContext::value(const std::string& key) const {
  std::optional<std::string> out;
  for (const auto& [k, v] : args_)
    if (k == key) out = v;
  return out;
}

void RunContext::read(const std::string& key, Reader by) {
  const bool given = std::any_of(args_.begin(), args_.end(), [&](const Pair& p) { return p.first == key; });
  if (given) reads_.try_emplace(key, Read{by, runs_started_});
}

std::optional<RunContext::Read> RunContext::first_read(const std::string& key) const {
  const auto it = reads_.find(key);
  if (it == reads_.end()) return std::nullopt;
  return it->second;
}

std::vector<RunContext::Pair> RunContext::report_unread(const std::function<bool(const std::string&)>& only) {
  std::vector<Pair> out;
  std::vector<std::string> keys;
  for (const auto& [k, v] : args_) {
    if (reads_.count(k) || reported_.count(k) || (only && !only(k))) continue;
    out.emplace_back(k, v);
    keys.push_back(k);
  }
  for (const auto& k : keys) reported_.insert(k);
  return out;
}

std::string join_pairs(const std::vector<RunContext::Pair>& pairs) {
  std::string s;
  for (const auto& [k, v] : pairs) s += (s.empty() ? "" : " ") + k + "=" + v;
  return s;
}

}  // namespace wick
