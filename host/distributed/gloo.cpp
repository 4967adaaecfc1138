// The gloo backend (CPU tensors). Its own TU: ProcessGroupGloo.hpp needs gloo's headers.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "distributed/group.hpp"

namespace wick {

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                            std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  // Loopback for a single node, else the address this host resolves to.
  opts->devices.push_back(env.world_size == env.local_world_size
                              ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                              : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
}

}  // namespace wick
