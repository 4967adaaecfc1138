// The host's cost per optimizer step: the engine's run (what wick.train
// calls: plugin calls, loader windows, metrics JSONL and TensorBoard events)
// against a bare C++ LibTorch loop doing the same forward, backward and AdamW
// update on the same model and batch size. Both are timed in the steady
// state, from the end of step 1 to the end of the last step (the run's own
// `time` of each step): the run's start and end (folders, run.json, the final
// model file) are printed apart, as a fixed cost per run.
//   build/bin/wick-bench-step [steps] [tiny|large]   (one case only: for a profiler)
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "plugin/registry.hpp"
#include "train/run.hpp"

namespace {

double bare_loop(std::int64_t inputs, std::int64_t hidden, std::int64_t classes, std::int64_t batch, int steps) {
  torch::nn::Sequential net(torch::nn::Linear(inputs, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden),
                            torch::nn::ReLU(), torch::nn::Linear(hidden, classes));
  // The same AdamW arithmetic as wick's adamw plugin (and torch.optim.AdamW).
  struct State {
    at::Tensor m, v;
  };
  std::vector<at::Tensor> params = net->parameters();
  std::vector<State> state;
  for (auto& p : params) state.push_back({at::zeros_like(p), at::zeros_like(p)});
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  at::Tensor x = at::randn({steps * batch, inputs});
  at::Tensor y = at::randint(0, classes, {steps * batch});
  auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    if (s == 1) t0 = std::chrono::steady_clock::now();  // from the end of step 1, as for wick
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    auto xb = x.narrow(0, s * batch, batch), yb = y.narrow(0, s * batch, batch);
    auto loss = at::cross_entropy_loss(net->forward(xb), yb);
    loss.backward();
    {
      at::NoGradGuard no_grad;
      const double bc1 = 1 - std::pow(b1, s + 1), bc2 = std::sqrt(1 - std::pow(b2, s + 1));
      for (std::size_t i = 0; i < params.size(); ++i) {
        auto& p = params[i];
        const auto& g = p.grad();
        p.mul_(1 - lr * wd);
        state[i].m.lerp_(g, 1 - b1);
        state[i].v.mul_(b2).addcmul_(g, g, 1 - b2);
        p.addcdiv_(state[i].m, (state[i].v.sqrt() / bc2).add_(eps), -lr / bc1);
      }
    }
    (void)loss.item<double>();  // wick reads the loss every step too
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (steps - 1);
}

struct WickTimes {
  double per_step = 0;  // steady state: end of step 1 to the end of the last step
  double fixed = 0;     // the rest of the run's seconds: start and end
};

WickTimes wick_loop(std::int64_t inputs, std::int64_t hidden, std::int64_t classes, std::int64_t micro,
                    std::int64_t accumulate, int steps, const std::string& out) {
  using wick::Value;
  std::error_code ec;
  std::filesystem::remove_all(out, ec);  // a fresh run folder each time (no overwrite notice)
  wick::RunRequest req;
  auto& reg = wick::registry();
  req.objects.data = std::static_pointer_cast<wick::Dataset>(reg.create(
      "synthetic", wick::PluginKind::Data,
      {{"size", Value(steps * micro * accumulate)}, {"inputs", Value(inputs)}, {"classes", Value(classes)}}));
  req.objects.model = std::static_pointer_cast<wick::Model>(reg.create(
      "mlp", wick::PluginKind::Model,
      {{"inputs", Value(inputs)}, {"hidden", Value(wick::List{Value(hidden), Value(hidden)})}, {"outputs", Value(classes)}}));
  req.objects.optim = reg.create("adamw", wick::PluginKind::Optim, {{"lr", Value(1e-3)}});
  req.options = {{"micro_batch", Value(micro)}, {"accumulate", Value(accumulate)}, {"max_steps", Value(steps)},
                 {"quiet", Value(true)}, {"out", Value(out)}};
  const auto run = wick::run_training(req);
  const auto& h = run.at("history");
  const double first = h.front().at("time").get<double>(), end = h.back().at("time").get<double>();
  WickTimes t;
  t.per_step = (end - first) / static_cast<double>(h.size() - 1);
  t.fixed = run.at("seconds").get<double>() - (end - first);
  return t;
}

}  // namespace

int run(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 200;
  if (steps < 2) throw std::runtime_error("steps: expected at least 2, got " + std::string(argc > 1 ? argv[1] : ""));
  const std::string out = (std::filesystem::temp_directory_path() / "wick-bench-step").string();
  std::printf("per optimizer step in the steady state (steps 2-%d), best of 3 interleaved runs, %d intra-op threads, "
              "metrics JSONL and TensorBoard events on\n", steps, at::get_num_threads());
  std::printf("%-28s %12s %12s %12s %8s %14s\n", "model (batch 32)", "bare C++", "wick 32x1", "wick 8x4", "ratio",
              "run start+end");
  struct Case {
    const char* name;
    std::int64_t inputs, hidden, classes;
  } cases[] = {{"mlp 32-64-64-4 (tiny)", 32, 64, 4}, {"mlp 256-1024-1024-10", 256, 1024, 10}};
  const std::string only = argc > 2 ? argv[2] : "";
  if (!only.empty() && only != "tiny" && only != "large")
    throw std::runtime_error("the case '" + only + "' is neither tiny nor large");
  for (const auto& c : cases) {
    if ((only == "tiny" && c.hidden != 64) || (only == "large" && c.hidden == 64)) continue;
    // Interleaved repeats, best of each: the allocator's and the caches' warm-up
    // would otherwise favour whichever loop runs second.
    double bare = 1e9, w1 = 1e9, w4 = 1e9, fixed = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      bare = std::min(bare, bare_loop(c.inputs, c.hidden, c.classes, 32, steps));
      const WickTimes a = wick_loop(c.inputs, c.hidden, c.classes, 32, 1, steps, out);
      w1 = std::min(w1, a.per_step);
      fixed = std::min(fixed, a.fixed);
      w4 = std::min(w4, wick_loop(c.inputs, c.hidden, c.classes, 8, 4, steps, out).per_step);
    }
    std::printf("%-28s %9.3f ms %9.3f ms %9.3f ms %7.2fx %11.1f ms\n", c.name, bare * 1e3, w1 * 1e3, w4 * 1e3, w1 / bare,
                fixed * 1e3);
  }
  std::printf("ratio: wick (micro 32, accumulate 1) / bare loop; 8x4 is the same batch split in 4; run start+end: "
              "the rest of a 32x1 run's seconds (folders, run.json, the final model file), once per run\n");
  std::error_code ec;
  std::filesystem::remove_all(out, ec);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wick-bench-step: error: %s\n", e.what());
    return 1;
  }
}
