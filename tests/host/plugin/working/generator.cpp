// A working Generator (wick/model.hpp): it continues a sequence by counting,
// each new id (last + step) mod vocab, and keeps every GenerateOptions
// promise a model makes: max_new_tokens, eos_id and eos_ids (the end token
// is returned, then it stops), on_token for each id, stop() after it.
#include <wick/model.hpp>
#include <wick/plugin.hpp>

#include <ATen/ATen.h>

#include <algorithm>

namespace {
class Counter : public wick::Model, public wick::Generator {
 public:
  explicit Counter(const wick::Options& o) : vocab_(o.get_int("vocab")), step_(o.get_int("step")) {
    w_ = register_parameter("w", at::zeros({1}));
  }
  wick::ForwardResult forward(const wick::Batch& b) override {
    return {(w_ * 0).sum() + b.begin()->second.to(at::kFloat).sum() * 0, b.begin()->second.size(0), {}};
  }
  std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt,
                                     const wick::GenerateOptions& opts) override {
    if (prompt.empty()) throw wick::Error("test_generator: an empty prompt");
    std::vector<std::int64_t> out;
    std::int64_t last = prompt.back();
    while (static_cast<std::int64_t>(out.size()) < opts.max_new_tokens) {
      last = (last + step_) % vocab_;
      out.push_back(last);
      if (opts.on_token) opts.on_token(last);
      const bool end = last == opts.eos_id ||
                       std::find(opts.eos_ids.begin(), opts.eos_ids.end(), last) != opts.eos_ids.end();
      if (end || (opts.stop && opts.stop())) break;
    }
    return out;
  }

 private:
  std::int64_t vocab_, step_;
  at::Tensor w_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<Counter>("test_generator", "continues a sequence by counting (generate())",
                                  {wick::opt_int("vocab", 100, "ids are taken modulo this").at_least(2),
                                   wick::opt_int("step", 1, "what each new id adds to the last").at_least(1)}))
