// The NCCL backend (CUDA tensors). Compiled and linked in every CUDA build,
// run only where GPUs are.
#include "distributed/group.hpp"

#ifdef WICK_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "wick/options.hpp"

namespace wick {

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                            std::chrono::milliseconds timeout) {
#ifdef WICK_WITH_CUDA
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, opts);
#else
  (void)store, (void)env, (void)timeout;
  throw Error("this wick was built without CUDA: the nccl backend is not available (use gloo on CPU)");
#endif
}

}  // namespace wick
