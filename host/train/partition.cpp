#include "train/partition.hpp"

#include <map>
#include <mutex>
#include <utility>

#include "wick/model.hpp"

namespace wick {

// shard = "parameters": the models whose weights a trainer holds divided now
// (or lost with a run that failed while they were), with what to tell a
// reader; a model gone since frees its address for another
namespace {

std::mutex partitioned_mu;
std::map<const Model*, std::pair<std::weak_ptr<Model>, std::string>>& partitioned_models() {
  static std::map<const Model*, std::pair<std::weak_ptr<Model>, std::string>> m;
  return m;
}
}  // namespace

void mark_partitioned(const std::shared_ptr<Model>& m, const std::string& why) {
  std::lock_guard<std::mutex> lock(partitioned_mu);
  if (why.empty()) partitioned_models().erase(m.get());
  else partitioned_models()[m.get()] = {m, why};
}

std::string weights_partitioned(const Model& model) {
  std::lock_guard<std::mutex> lock(partitioned_mu);
  auto& all = partitioned_models();
  auto it = all.find(&model);
  if (it == all.end()) return "";
  if (it->second.first.expired()) {  // another model at a freed address
    all.erase(it);
    return "";
  }
  return it->second.second;
}

}  // namespace wick
