// optim `adamw8bit`: AdamW whose two moments are kept in 8 bits, blockwise
// quantized with the dynamic map, as bitsandbytes' AdamW8bit keeps them:
// about 2 bytes of state per parameter instead of 8. Each step dequantizes a
// chunk of the moments to fp32, applies PyTorch's AdamW rule, and quantizes
// them back to the nearest code of their block (absmax-scaled). Tensors with
// fewer than min_8bit_size elements keep fp32 moments, as bitsandbytes does.

#include <wick/kit/dynamic_map.hpp>
#include <wick/optim.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

// a number as a recipe would write it (0.9, not 0.900000)
std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(17) << v;
  std::string t = s.str();
  for (int p = 1; p <= 17; ++p) {  // the shortest that reads back the same
    std::ostringstream u;
    u << std::setprecision(p) << v;
    if (std::stod(u.str()) == v) return u.str();
  }
  return t;
}

// The engine's fused CUDA step (host/kernels/adamw8bit_op.cpp), when the
// engine that loaded this plugin was built with CUDA: a whole parameter's
// step in one kernel, where the ATen step below makes some forty launches a
// chunk of 2^20 values.
const std::optional<c10::OperatorHandle>& fused_step() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"wick::adamw8bit_step_", ""});
  return op;
}

// One 8-bit moment of one tensor: codes (uint8, the tensor's element count)
// and one fp32 absmax per block.
struct Quantized {
  at::Tensor codes, absmax;
};

// The nearest code on the CPU without a search: a float's top 17 bits (sign,
// exponent, 7 mantissa bits) pick a cell of values at most 2^-8 wide relative
// to them, narrower than any gap between two midpoints of the dynamic maps,
// so a cell holds at most one midpoint: its code is the cell's lowest code,
// plus one above that midpoint. The same codes as the first midpoint >= the
// value (wick::nearest, bucketize).
struct CodeTable {
  std::vector<std::uint8_t> code;
  std::vector<float> mid;  // +inf: no midpoint in the cell
  bool exact = true;       // false: some cell holds two midpoints (not for these maps)

  explicit CodeTable(const at::Tensor& map) : code(kCells), mid(kCells, INFINITY) {
    const at::Tensor mt = ((map.slice(0, 1) + map.slice(0, 0, map.numel() - 1)) / 2).contiguous();
    const float* m = mt.data_ptr<float>();
    const float* end = m + mt.numel();
    for (std::uint32_t k = 0; k < kCells; ++k) {
      const float a = std::bit_cast<float>(k << kShift), b = std::bit_cast<float>((k << kShift) | ((1u << kShift) - 1));
      if (std::isnan(a) || std::isnan(b)) continue;  // code 0, as a search for NaN finds
      const float lo = std::min(a, b), hi = std::max(a, b);
      const auto below = std::lower_bound(m, end, lo) - m;  // midpoints < lo
      const auto upto = std::upper_bound(m, end, hi) - m;   // midpoints <= hi
      code[k] = static_cast<std::uint8_t>(below);
      if (upto == below + 1) mid[k] = m[below];
      else if (upto > below + 1) exact = false;
    }
  }
  std::uint8_t operator()(float v) const {
    const std::uint32_t k = std::bit_cast<std::uint32_t>(v) >> kShift;
    return static_cast<std::uint8_t>(code[k] + (v > mid[k]));
  }
  static constexpr std::uint32_t kShift = 15, kCells = 1u << (32 - kShift);
};

class AdamW8bit : public wick::Optimizer, public wick::ElementwiseUpdates {
 public:
  explicit AdamW8bit(const wick::Options& o)
      : lr_(o.get_number("lr")),
        eps_(o.get_number("eps")),
        weight_decay_(o.get_number("weight_decay")),
        block_(o.get_int("block_size")),
        min_8bit_(o.get_int("min_8bit_size")),
        chunk_(o.get_int("chunk_size")) {
    const auto betas = o.get_number_list("betas");
    if (betas.size() != 2)
      throw wick::Error("optim 'adamw8bit': option 'betas': expected 2 numbers, got " + std::to_string(betas.size()));
    beta1_ = betas[0];
    beta2_ = betas[1];
    if (beta1_ < 0 || beta1_ >= 1 || beta2_ < 0 || beta2_ >= 1)
      throw wick::Error("optim 'adamw8bit': option 'betas': expected values in [0, 1), got {" + number(beta1_) + ", " +
                        number(beta2_) + "}");
    chunk_ = std::max<std::int64_t>(block_, chunk_ / block_ * block_);  // whole blocks per chunk
    signed_map_ = wick::dynamic_map(/*is_signed=*/true);
    unsigned_map_ = wick::dynamic_map(/*is_signed=*/false);
    tables_ = {CodeTable(signed_map_), CodeTable(unsigned_map_)};
  }

  void attach(wick::NamedTensors params) override { params_ = std::move(params); }
  // a piece of a parameter split across ranks: 8-bit or fp32 moments as for
  // the whole parameter, in blocks that line up with the whole's
  void attach_shard(wick::NamedTensors params, const std::vector<std::int64_t>& whole) override {
    whole_.clear();
    for (std::size_t k = 0; k < params.size() && k < whole.size(); ++k) {
      whole_[params[k].first] = whole[k];
      if (whole[k] != params[k].second.numel() && wick::kShardAlign % block_ != 0)
        throw wick::Error("optim 'adamw8bit': block_size " + std::to_string(block_) + " does not divide " +
                          std::to_string(wick::kShardAlign) + ", where sharded runs cut parameters ('" +
                          params[k].first + "' is cut across ranks): use a power of two up to it");
    }
    attach(std::move(params));
  }
  double base_lr() const override { return lr_; }

  void step(double lr) override {
    for (auto& [name, p] : params_) {
      if (!p.grad().defined()) continue;
      auto& s = state_[name];
      if (!s.started) init(s, name, p);
      s.step += 1;
      const double c1 = 1 - std::pow(beta1_, s.step);
      const double c2 = std::sqrt(1 - std::pow(beta2_, s.step));
      // the weight and gradient as flat views; a non-contiguous weight is
      // updated through a contiguous copy
      at::Tensor w = p.detach().is_contiguous() ? p.detach().view({-1}) : p.detach().contiguous().view({-1});
      const at::Tensor g = p.grad().contiguous().view({-1});
      const auto dt = w.scalar_type();
      if (!s.quantized) {
        update(w, g, s.exp_avg, s.exp_avg_sq, lr, c1, c2);
      } else if (w.is_cuda() && g.scalar_type() == dt && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) &&
                 fused_step()) {
        const auto& maps = device_maps(p.device());
        static const auto op =
            fused_step()
                ->typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, std::int64_t,
                             double, double, double, double, double, double, double)>();
        op.call(w, g, s.m.codes, s.m.absmax, s.v.codes, s.v.absmax, maps.first, maps.second, block_, beta1_, beta2_,
                eps_, lr, weight_decay_, c1, c2);
      } else {
        const auto& maps = device_maps(p.device());
        const std::int64_t n = w.numel();
        for (std::int64_t start = 0; start < n; start += chunk_) {
          const std::int64_t end = std::min(n, start + chunk_);
          const std::int64_t b0 = start / block_, b1 = (end + block_ - 1) / block_;
          Quantized m{s.m.codes.slice(0, start, end), s.m.absmax.slice(0, b0, b1)};
          Quantized v{s.v.codes.slice(0, start, end), s.v.absmax.slice(0, b0, b1)};
          at::Tensor mf = dequantize(m, maps.first), vf = dequantize(v, maps.second);
          update(w.slice(0, start, end), g.slice(0, start, end), mf, vf, lr, c1, c2);
          quantize(mf, maps.first, tables_[0], m);
          quantize(vf, maps.second, tables_[1], v);
        }
      }
      if (!p.detach().is_contiguous()) p.detach().copy_(w.view(p.sizes()));
    }
  }

  std::int64_t state_bytes(const wick::NamedTensors& params) const override {
    std::int64_t n = 0;
    for (const auto& [name, p] : params) {
      const std::int64_t k = p.numel();
      const auto whole = whole_.find(name);  // a piece: 8-bit or not as its whole parameter
      n += (whole != whole_.end() ? whole->second : k) >= min_8bit_ ? 2 * (k + 4 * ((k + block_ - 1) / block_)) : 2 * 4 * k;
    }
    return n;
  }

  // elementwise entries in the parameter's shape (bitsandbytes keeps its
  // state so; a sharded run joins the pieces' into that shape too)
  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, p] : params_) {
      auto it = state_.find(name);
      if (it == state_.end() || !it->second.started) continue;
      const auto& s = it->second;
      out[name + ".step"] = at::scalar_tensor(static_cast<double>(s.step), at::kFloat);
      if (s.quantized) {
        out[name + ".exp_avg.codes"] = s.m.codes.view(p.sizes());
        out[name + ".exp_avg.absmax"] = s.m.absmax;
        out[name + ".exp_avg_sq.codes"] = s.v.codes.view(p.sizes());
        out[name + ".exp_avg_sq.absmax"] = s.v.absmax;
      } else {
        out[name + ".exp_avg"] = s.exp_avg.view(p.sizes());
        out[name + ".exp_avg_sq"] = s.exp_avg_sq.view(p.sizes());
      }
    }
    return out;
  }

  void load_state(const std::map<std::string, at::Tensor>& in) override {
    state_.clear();
    for (const auto& [name, p] : params_) {
      auto step = in.find(name + ".step");
      if (step == in.end()) continue;
      auto& s = state_[name];
      init(s, name, p);
      s.step = static_cast<std::int64_t>(step->second.item<double>());
      auto take = [&](const std::string& key, at::Tensor& into) {
        auto it = in.find(name + "." + key);
        if (it == in.end())
          throw wick::Error("optim 'adamw8bit': state of '" + name + "' has no '" + key + "' (" +
                            (s.quantized ? "8-bit" : "fp32") + " moments expected for " + std::to_string(p.numel()) +
                            " elements with min_8bit_size " + std::to_string(min_8bit_) + ")");
        if (it->second.numel() != into.numel() || it->second.scalar_type() != into.scalar_type())
          throw wick::Error("optim 'adamw8bit': state '" + name + "." + key + "': expected " +
                            std::to_string(into.numel()) + " elements of " + std::string(c10::toString(into.scalar_type())) +
                            ", got " + std::to_string(it->second.numel()) + " of " +
                            std::string(c10::toString(it->second.scalar_type())) + " (another block_size?)");
        into.copy_(it->second.reshape(into.sizes()));
      };
      if (s.quantized) {
        take("exp_avg.codes", s.m.codes);
        take("exp_avg.absmax", s.m.absmax);
        take("exp_avg_sq.codes", s.v.codes);
        take("exp_avg_sq.absmax", s.v.absmax);
      } else {
        take("exp_avg", s.exp_avg);
        take("exp_avg_sq", s.exp_avg_sq);
      }
    }
  }

 private:
  struct ParamState {
    bool started = false, quantized = false;
    std::int64_t step = 0;
    Quantized m, v;                 // 8-bit moments (large tensors)
    at::Tensor exp_avg, exp_avg_sq;  // fp32 moments, flat (small tensors)
  };

  void init(ParamState& s, const std::string& name, const at::Tensor& p) {
    s.started = true;
    s.step = 0;
    const std::int64_t n = p.numel();
    const auto f32 = p.options().dtype(at::kFloat);
    const auto whole = whole_.find(name);
    s.quantized = (whole != whole_.end() ? whole->second : n) >= min_8bit_;
    if (s.quantized) {
      const std::int64_t blocks = (n + block_ - 1) / block_;
      // zero moments: every code is the map's 0 under any absmax
      const auto zero_code = [&](const at::Tensor& map) {
        return at::full({n}, (map == 0).nonzero().min().item<std::int64_t>(), p.options().dtype(at::kByte));
      };
      s.m = {zero_code(signed_map_), at::zeros({blocks}, f32)};
      s.v = {zero_code(unsigned_map_), at::zeros({blocks}, f32)};
    } else {
      s.exp_avg = at::zeros({n}, f32);
      s.exp_avg_sq = at::zeros({n}, f32);
    }
  }

  // torch.optim.AdamW's rule (the one bitsandbytes' 8-bit step applies) on
  // flat fp32 moments; w is the weight's flat view, in its own dtype
  void update(at::Tensor w, const at::Tensor& grad, at::Tensor& m, at::Tensor& v, double lr, double c1,
              double c2) const {
    const at::Tensor g = grad.to(at::kFloat);
    const bool fp32 = w.scalar_type() == at::kFloat;
    at::Tensor wf = fp32 ? w : w.to(at::kFloat);
    m.mul_(beta1_).add_(g, 1 - beta1_);
    v.mul_(beta2_).addcmul_(g, g, 1 - beta2_);
    const at::Tensor denom = (v.sqrt() / c2).add_(eps_);
    if (weight_decay_ > 0) wf.mul_(1 - lr * weight_decay_);
    wf.addcdiv_(m, denom, -lr / c1);
    if (!fp32) w.copy_(wf);
  }

  // codes -> fp32: map[code] x its block's absmax
  at::Tensor dequantize(const Quantized& q, const at::Tensor& map) const {
    const std::int64_t n = q.codes.numel(), full = n / block_ * block_;
    if (q.codes.is_cpu()) {  // one pass, no index tensor: the same products
      at::Tensor out = at::empty({n}, map.options());
      const auto* c = q.codes.data_ptr<std::uint8_t>();
      const auto* a = q.absmax.data_ptr<float>();
      const auto* mp = map.data_ptr<float>();
      auto* o = out.data_ptr<float>();
      const std::int64_t block = block_;
      at::parallel_for(0, (n + block - 1) / block, 64, [&](std::int64_t b0, std::int64_t b1) {
        for (std::int64_t b = b0; b < b1; ++b)
          for (std::int64_t i = b * block, e = std::min(n, i + block); i < e; ++i) o[i] = mp[c[i]] * a[b];
      });
      return out;
    }
    at::Tensor out = map.index_select(0, q.codes.to(at::kInt));
    if (full > 0) out.slice(0, 0, full).view({-1, block_}).mul_(q.absmax.slice(0, 0, full / block_).unsqueeze(1));
    if (full < n) out.slice(0, full, n).mul_(q.absmax.slice(0, full / block_));
    return out;
  }

  // fp32 -> the nearest code of x / absmax, per block (ties to the lower
  // code); an all-zero block keeps absmax 0 and the map's zero
  void quantize(const at::Tensor& x, const at::Tensor& map, const CodeTable& table, Quantized& q) const {
    const std::int64_t n = x.numel(), full = n / block_ * block_;
    at::Tensor normed = at::empty_like(x);
    auto scale = [&](std::int64_t a, std::int64_t b, std::int64_t blk0, std::int64_t blk1, std::int64_t width) {
      const at::Tensor xs = x.slice(0, a, b).view({-1, width});
      const at::Tensor amax = xs.abs().amax(1);
      q.absmax.slice(0, blk0, blk1).copy_(amax);
      at::Tensor into = normed.slice(0, a, b).view({-1, width});
      at::div_out(into, xs, at::where(amax > 0, amax, at::ones_like(amax)).unsqueeze(1));
    };
    if (full > 0) scale(0, full, 0, full / block_, block_);
    if (full < n) scale(full, n, full / block_, full / block_ + 1, n - full);
    if (!normed.is_cpu() || !table.exact) {
      q.codes.copy_(wick::nearest(normed, map));
      return;
    }
    const auto* v = normed.data_ptr<float>();
    auto* c = q.codes.data_ptr<std::uint8_t>();
    at::parallel_for(0, n, 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) c[i] = table(v[i]);
    });
  }

  const std::pair<at::Tensor, at::Tensor>& device_maps(const at::Device& d) {
    auto it = maps_.find(d.str());
    if (it == maps_.end()) it = maps_.emplace(d.str(), std::make_pair(signed_map_.to(d), unsigned_map_.to(d))).first;
    return it->second;
  }

  double lr_, eps_, weight_decay_, beta1_ = 0.9, beta2_ = 0.999;
  std::int64_t block_, min_8bit_, chunk_;
  at::Tensor signed_map_, unsigned_map_;
  std::vector<CodeTable> tables_;  // signed, unsigned
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> maps_;
  wick::NamedTensors params_;
  std::map<std::string, std::int64_t> whole_;  // sharded: the whole parameter's elements, by name
  std::map<std::string, ParamState> state_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<AdamW8bit>(
    "adamw8bit", "AdamW with 8-bit blockwise-quantized moments (bitsandbytes' AdamW8bit; ~2 bytes of state per parameter)",
    {wick::opt_number("lr", 1e-3, "learning rate").at_least(0),
     wick::opt("betas", wick::OptionType::NumberList, wick::List{0.9, 0.999}, "coefficients of the running averages"),
     wick::opt_number("eps", 1e-8, "term added to the denominator").at_least(0),
     wick::opt_number("weight_decay", 0.01, "decoupled weight decay").at_least(0),
     wick::opt_int("block_size", 256, "elements sharing one absmax in the 8-bit moments").range(16, 1 << 16),
     wick::opt_int("min_8bit_size", 4096, "tensors with fewer elements keep fp32 moments").at_least(0),
     wick::opt_int("chunk_size", 1 << 20, "elements dequantized at once in a step (bounds the fp32 temporaries)")
         .at_least(1)}))
