// The chunked output head and cross-entropy (plugins/lib/decoder: loss_chunk)
// against the plain path (loss_chunk = 0: the whole [tokens, vocab] logits) on
// the same weights and batch: the loss, the item count, the accuracy and
// every gradient (hidden states, head, tied embedding) agree in fp32 within
// 1e-5 relative, with ignored labels and chunks holding only ignored labels,
// under bf16 autocast (against the plain path under the same autocast),
// with activation checkpointing, and with LoRA / QLoRA with
// modules_to_save = {"lm_head"}.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>

#include "../../../test_util.hpp"
#include "train/activation_checkpoint.hpp"
#include "util/memory.hpp"
#include "wick/optim.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

std::shared_ptr<Model> decoder(std::int64_t chunk, bool tie, const std::string& dtype = "fp32") {
  at::manual_seed(0);
  std::map<std::string, Value> o = {{"vocab_size", Value(std::int64_t{300})}, {"hidden_size", Value(std::int64_t{32})},
                                    {"intermediate_size", Value(std::int64_t{64})}, {"layers", Value(std::int64_t{2})},
                                    {"heads", Value(std::int64_t{4})},           {"tie_embeddings", Value(tie)},
                                    {"loss_chunk", Value(chunk)},                 {"dtype", Value(dtype)}};
  return test::make<Model>("decoder_lm", PluginKind::Model, o);
}

// to's parameters and buffers := from's (same names)
void copy_state(Model& from, Model& to) {
  at::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(src[p.key()]);
  auto bsrc = from.named_buffers();
  for (auto& b : to.named_buffers()) b.value().copy_(bsrc[b.key()]);
}

// input_ids [3, 17]; labels with scattered -100s and the rows 8..15 of the
// shifted [48] targets all ignored (a chunk of 8 holding no label)
Batch batch() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor ids = at::randint(0, 300, {3, 17}, gen);
  at::Tensor labels = ids.clone();
  labels.index_put_({0, at::indexing::Slice(0, 4)}, -100);  // a prompt
  labels.view({-1}).narrow(0, 9, 8).fill_(-100);            // targets 8..15 (label column 1 onwards, row 0)
  labels.index_put_({2, 5}, -100);
  labels.index_put_({2, 11}, -100);
  return {{"input_ids", ids}, {"labels", labels}};
}

struct Outcome {
  ForwardResult r;
  std::map<std::string, at::Tensor> grads;
};

Outcome run(Model& m, const Batch& b, bool autocast = false) {
  for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
  Outcome out;
  {
    at::autocast::set_autocast_enabled(at::kCPU, autocast);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    try {
      out.r = m.forward(b);
    } catch (...) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      throw;
    }
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  out.r.loss_sum.backward();
  for (auto& p : m.named_parameters())
    if (p.value().grad().defined()) out.grads[p.key()] = p.value().grad().clone();
  return out;
}

// |a - b| <= tol * max|b| elementwise, per tensor (tol relative to the tensor's
// scale); head_tol for the head's weight (lm_head or the tied embedding)
void expect_close(const Outcome& plain, const Outcome& chunked, double tol, double head_tol = 0) {
  if (head_tol == 0) head_tol = tol;
  const double lp = plain.r.loss_sum.item<double>(), lc = chunked.r.loss_sum.item<double>();
  EXPECT_LE(std::abs(lp - lc), tol * std::abs(lp)) << "loss " << lp << " vs " << lc;
  EXPECT_EQ(plain.r.items, chunked.r.items);
  EXPECT_EQ(plain.r.metrics.at("accuracy").item<std::int64_t>(), chunked.r.metrics.at("accuracy").item<std::int64_t>());
  ASSERT_EQ(plain.grads.size(), chunked.grads.size());
  for (const auto& [n, g] : plain.grads) {
    ASSERT_TRUE(chunked.grads.count(n)) << n << " got no gradient in the chunked path";
    const at::Tensor c = chunked.grads.at(n);
    const double scale = g.abs().max().item<double>();
    const double diff = (g.to(at::kDouble) - c.to(at::kDouble)).abs().max().item<double>();
    const bool head = n == "lm_head.weight" || n == "model.embed_tokens.weight";
    EXPECT_LE(diff, (head ? head_tol : tol) * scale + 1e-12) << n << ": max difference " << diff << " at scale " << scale;
  }
}

TEST(ChunkedLoss, EqualsThePlainPathInFp32UntiedAndTied) {
  for (bool tie : {false, true})
    for (std::int64_t chunk : {8, 5, 1024}) {  // chunks of whole rows, a ragged last chunk, one chunk
      SCOPED_TRACE("tie " + std::to_string(tie) + ", chunk " + std::to_string(chunk));
      auto plain = decoder(0, tie), chunked = decoder(chunk, tie);
      copy_state(*plain, *chunked);
      const Batch b = batch();
      const Outcome p = run(*plain, b), c = run(*chunked, b);
      EXPECT_EQ(p.r.items, 48 - 4 - 8 - 2 + 1);  // row 0's prompt and the run of 8 overlap in one target
      ASSERT_EQ(p.grads.count(tie ? "model.embed_tokens.weight" : "lm_head.weight"), 1u);
      expect_close(p, c, 1e-5);
    }
}

// A tied head's backward adds its part straight into the embedding's
// gradient, and the lookup's part arrives sparse: with the gradient already
// there (a second micro-batch), backward makes no [vocab, hidden] temporary.
// Before, the head's gradient buffer and the lookup's dense gradient were two.
TEST(ChunkedLoss, ATiedHeadsBackwardMakesNoVocabularySizedTemporary) {
  const std::int64_t V = 32768, H = 128;
  auto make = [&](std::int64_t chunk) {
    at::manual_seed(0);
    std::map<std::string, Value> o = {{"vocab_size", Value(V)}, {"hidden_size", Value(H)},
                                      {"intermediate_size", Value(std::int64_t{64})}, {"layers", Value(std::int64_t{1})},
                                      {"heads", Value(std::int64_t{4})}, {"tie_embeddings", Value(true)},
                                      {"loss_chunk", Value(chunk)}};
    return test::make<Model>("decoder_lm", PluginKind::Model, o);
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<Batch> window;
  for (int k = 0; k < 2; ++k) {
    at::Tensor ids = at::randint(0, V, {2, 16}, gen);
    window.push_back({{"input_ids", ids}, {"labels", ids}});
  }
  auto chunked = make(1024), plain = make(0);
  copy_state(*plain, *chunked);
  for (auto* m : {chunked.get(), plain.get()})
    for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  const std::int64_t vh = V * H * 4;  // one fp32 [vocab, hidden]
  for (std::size_t k = 0; k < window.size(); ++k) {
    plain->forward(window[k]).loss_sum.backward();
    const auto held = cpu_tensor_memory().allocated;
    reset_cpu_tensor_peak();
    chunked->forward(window[k]).loss_sum.backward();
    const auto rise = cpu_tensor_memory().peak - held;
    // micro-batch 1 makes the gradient itself; micro-batch 2 adds into it
    if (k == 1) EXPECT_LT(rise, vh / 2) << "backward rose " << rise << " bytes above what was held; [vocab, hidden] is " << vh;
    else EXPECT_LT(rise, vh + vh / 2) << "the first backward made more than the gradient";
  }
  // the gradients summed over both micro-batches equal the whole-logits path's
  auto pg = plain->named_parameters();
  for (auto& p : chunked->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_FALSE(p.value().grad().is_sparse()) << p.key();
    const at::Tensor want = pg[p.key()].grad();
    const double diff = (p.value().grad() - want).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * want.abs().max().item<double>() + 1e-12) << p.key();
  }
}

TEST(ChunkedLoss, EveryLabelIgnoredGivesZeroLossAndZeroGradients) {
  auto plain = decoder(0, true), chunked = decoder(8, true);
  copy_state(*plain, *chunked);
  Batch b = batch();
  b["labels"] = at::full_like(b["labels"], -100);
  const Outcome p = run(*plain, b), c = run(*chunked, b);
  EXPECT_EQ(c.r.items, 0);
  EXPECT_EQ(c.r.loss_sum.item<double>(), 0.0);
  expect_close(p, c, 1e-5);
  for (const auto& [n, g] : c.grads) EXPECT_EQ(g.abs().max().item<double>(), 0.0) << n;
}

// bf16 autocast: both paths multiply in bf16 and take the softmax in fp32, but
// group the head's rows differently, and a bf16 product rounds by its
// blocking: the head's weight gradient agrees within 1e-2 of its scale (the
// chunked path sums it over chunks in fp32 where the plain one rounds one bf16
// product; measured 5e-3), and the gradients below it within 2^-6 (four bf16
// steps of each tensor's largest entry: the head's rounding differences pass
// back through every layer; measured up to 6.4e-3 with transformers'
// initialisation). A wrong gradient is off by its own size, not by these.
TEST(ChunkedLoss, UnderBf16AutocastMatchesThePlainPathUnderTheSameAutocast) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE("tie " + std::to_string(tie));
    auto plain = decoder(0, tie), chunked = decoder(8, tie);
    copy_state(*plain, *chunked);
    const Batch b = batch();
    const Outcome p = run(*plain, b, true), c = run(*chunked, b, true);
    expect_close(p, c, 1.0 / 64, 1e-2);
    const double lp = p.r.loss_sum.item<double>(), lc = c.r.loss_sum.item<double>();
    EXPECT_LE(std::abs(lp - lc), 1e-3 * std::abs(lp)) << "the loss itself: " << lp << " vs " << lc;
    // and the autocast path is not the fp32 one: the head ran in bf16
    const Outcome f = run(*chunked, b, false);
    EXPECT_NE(f.r.loss_sum.item<double>(), c.r.loss_sum.item<double>());
  }
}

// bf16 weights (bf16-true): the head's gradient is accumulated over the
// chunks in bf16, its own dtype, where the plain path rounds one product.
TEST(ChunkedLoss, WithBf16WeightsMatchesThePlainPath) {
  auto plain = decoder(0, false, "bf16"), chunked = decoder(8, false, "bf16");
  copy_state(*plain, *chunked);
  const Batch b = batch();
  const Outcome p = run(*plain, b), c = run(*chunked, b);
  EXPECT_EQ(c.grads.at("lm_head.weight").scalar_type(), at::kBFloat16);
  expect_close(p, c, 1e-3, 1e-2);  // measured: the head within one bf16 step (5e-3), the rest equal
}

TEST(ChunkedLoss, WithActivationCheckpointingEqualsThePlainPath) {
  auto plain = decoder(0, false), chunked = decoder(8, false);
  copy_state(*plain, *chunked);
  auto blocks = chunked->blocks();
  CheckpointRunner runner({blocks.begin(), blocks.end()});
  chunked->set_block_runner(&runner);
  const Batch b = batch();
  const Outcome p = run(*plain, b), c = run(*chunked, b);
  chunked->set_block_runner(nullptr);
  expect_close(p, c, 1e-5);
}

TEST(ChunkedLoss, WithLoraAndQloraKeepingTheHeadTrainable) {
  for (const std::string kind : {"lora", "qlora"}) {
    SCOPED_TRACE(kind);
    auto plain = decoder(0, false), chunked = decoder(8, false);
    copy_state(*plain, *chunked);
    const std::map<std::string, Value> o = {{"r", Value(std::int64_t{4})},
                                            {"target_modules", Value(List{Value("q_proj"), Value("v_proj")})},
                                            {"modules_to_save", Value(List{Value("lm_head")})}};
    test::make<Transform>(kind, PluginKind::Optim, o)->apply(*plain);
    test::make<Transform>(kind, PluginKind::Optim, o)->apply(*chunked);
    copy_state(*plain, *chunked);
    {  // B starts at zero: make the adapters matter
      at::NoGradGuard no_grad;
      for (auto& p : plain->named_parameters())
        if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.1);
    }
    copy_state(*plain, *chunked);
    const Batch b = batch();
    const Outcome p = run(*plain, b), c = run(*chunked, b);
    ASSERT_TRUE(c.grads.count("lm_head.weight")) << "modules_to_save left the head without a gradient";
    bool adapters = false;
    for (const auto& [n, g] : c.grads) adapters = adapters || n.find("lora_A") != std::string::npos;
    EXPECT_TRUE(adapters);
    EXPECT_FALSE(c.grads.count("model.embed_tokens.weight"));  // frozen
    expect_close(p, c, 1e-5);
  }
}

TEST(ChunkedLoss, IsTheDefaultInDecoderLmAndVlm) {
  for (const std::string plugin : {"decoder_lm", "vlm"}) {
    bool found = false;
    for (const auto& o : registry().find(plugin).descriptor->options)
      if (o.name == "loss_chunk") found = o.default_value.is_nil() && o.doc.find("64 MiB") != std::string::npos;
    EXPECT_TRUE(found) << plugin;
  }
}

TEST(ChunkedLoss, ALabelOutsideTheVocabularyIsRefusedInWords) {
  auto m = decoder(8, false);
  Batch b = batch();
  b["labels"].index_put_({1, 3}, 300);
  try {
    m->forward(b);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("labels: 300 is outside the vocabulary of 300, expected -100 (ignored) or 0..299"));
  }
}

}  // namespace
}  // namespace wick
