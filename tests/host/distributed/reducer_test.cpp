// The gradient reducer on its own (distributed/reducer.hpp), on two gloo
// ranks in one process: buckets reduced during the backward (DDP), pieces
// of ZeRO-1/2, and ZeRO-3's units with their frozen tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "../../test_util.hpp"
#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "distributed/zero3.hpp"
#include "util/memory.hpp"
#include "wick/kit/nf4.hpp"
#include "wick/optim.hpp"

namespace wick {
namespace {

using test::ranks;
using test::two_ranks;

TEST(GradReducer, SumsGradientsOverRanksStartingBucketsDuringTheBackward) {
  two_ranks([](std::shared_ptr<Group> g) {
    // three layers, buckets small enough that each parameter has its own
    // the same weights on both ranks, from a generator of this thread's own
    // (the global one is shared by the two threads)
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    std::vector<at::Tensor> w;
    for (int k = 0; k < 3; ++k) w.push_back((at::randn({64, 64}, gen) * 0.2).requires_grad_());
    GradReducer r(g, w, /*bucket_mb=*/0.01);
    EXPECT_EQ(r.buckets(), 3u);
    auto loss_of = [&](int rank) {
      at::Tensor x = at::full({4, 64}, static_cast<double>(rank + 1));
      for (auto& p : w) x = at::tanh(x.mm(p));
      return x.sum();
    };
    r.arm();
    loss_of(g->rank()).backward();
    EXPECT_GE(r.launched_during_backward(), 2u);  // the last layers' buckets went before the backward ended
    r.finish(1);
    // reference: both ranks' losses in one backward on fresh copies
    std::vector<at::Tensor> ref;
    for (auto& p : w) ref.push_back(p.detach().clone().requires_grad_());
    at::Tensor total = at::zeros({});
    for (int rank = 0; rank < 2; ++rank) {
      at::Tensor x = at::full({4, 64}, static_cast<double>(rank + 1));
      for (auto& p : ref) x = at::tanh(x.mm(p));
      total = total + x.sum();
    }
    total.backward();
    for (std::size_t k = 0; k < w.size(); ++k) EXPECT_TRUE(at::allclose(w[k].grad(), ref[k].grad(), 1e-5, 1e-6));
  });
}

// gloo's worker wakes the waiter before it lets go of the collective's Work,
// which holds its tensors; a bucket freed after the wait would outlive it by
// however long that thread takes to run again, and a measured peak would
// depend on the machine's load (seen: a plan row a bucket higher under load).
// After Group::wait the caller holds them alone, every time.
TEST(Group, AfterAWaitTheCollectivesTensorsAreTheCallersAlone) {
  two_ranks([](std::shared_ptr<Group> g) {
    int shared_after = 0;
    for (int i = 0; i < 300; ++i) {
      std::vector<at::Tensor> v{at::ones({4096})};
      g->all_reduce(v, "an all-reduce");
      shared_after += v[0].use_count() > 1;
      at::Tensor in = at::ones({4096}), out = at::empty({2048});
      auto work = g->reduce_scatter_async(out, in);
      g->wait(work, "a reduce-scatter");
      work.reset();
      shared_after += in.use_count() > 1 || out.use_count() > 1;
      ASSERT_TRUE(at::equal(v[0], at::full({4096}, 2.0f)) && at::equal(out, at::full({2048}, 2.0f)));
    }
    EXPECT_EQ(shared_after, 0);
  });
}

// c10d's gloo reduce-scatter clones its whole input and all-reduces the
// clone: while a bucket is in flight a rank would hold it twice, which NCCL
// never does, and every sharded peak measured on the CPU carried the copy.
// wick's sums its input in place (the caller drops it) and copies the chunk
// out: both ranks' 4 MiB inputs and 2 MiB outputs, and nothing of their size more.
TEST(Group, AGlooReduceScatterMakesNoCopyOfItsInput) {
  install_memory_tracking();
  const std::int64_t base = cpu_tensor_memory().allocated;
  reset_cpu_tensor_peak();
  two_ranks([](std::shared_ptr<Group> g) {
    at::Tensor in = at::arange(1 << 20, at::kFloat).mul_(g->rank() + 1), out = at::empty({1 << 19});
    auto work = g->reduce_scatter_async(out, in);
    g->wait(work, "a reduce-scatter");
    const float* o = out.const_data_ptr<float>();  // (read in place: a check allocating would count)
    int wrong = 0;
    for (std::int64_t i = 0; i < (1 << 19); ++i) wrong += o[i] != 3.0f * static_cast<float>(i + (1 << 19) * g->rank());
    EXPECT_EQ(wrong, 0);
  });
  const std::int64_t grew = cpu_tensor_memory().peak - base, inputs_and_outputs = 2 * (4 << 20) + 2 * (2 << 20);
  EXPECT_GE(grew, inputs_and_outputs);
  EXPECT_LT(grew, inputs_and_outputs + (1 << 20)) << "a reduce-scatter held more than its input and output";
}

// c10d's gloo all-gather gathers into a temporary of the whole size and
// copies it out, a gathered unit more than NCCL holds; wick's or-s the bytes
// of the output, zero but for each rank's part, together: the bits each rank
// sent (-0.0, a NaN's payload, bf16 and 4-bit bytes), nothing of the
// output's size beside it.
TEST(Group, AGlooAllGatherKeepsEveryBitAndMakesNoTemporary) {
  install_memory_tracking();
  // what rank r sends, made the same way on every rank to check the gather
  const auto made = [](int r, at::ScalarType dtype) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(r + 1);
    at::Tensor t = dtype == at::kByte || dtype == at::kLong ? at::randint(0, 250, {4099}, gen, at::kLong).to(dtype)
                                                            : at::randn({4099}, gen).to(dtype);
    if (dtype == at::kFloat) {
      t[0] = -0.0f;
      t.view(at::kInt)[1] = 0x7fc01234;  // a NaN with a payload
    }
    return t;
  };
  two_ranks([&](std::shared_ptr<Group> g) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kByte, at::kLong}) {
      at::Tensor mine = made(g->rank(), dtype);
      at::Tensor all = at::full({2 * 4099}, 7, at::TensorOptions().dtype(dtype));
      g->all_gather(all, mine, "an all-gather");
      for (int r = 0; r < 2; ++r)  // each rank's part, as its own bytes
        EXPECT_TRUE(at::equal(all.narrow(0, r * 4099, 4099).view(at::kByte), made(r, dtype).view(at::kByte)))
            << "rank " << r << "'s part in " << dtype;
    }
  });
  const std::int64_t base = cpu_tensor_memory().allocated;
  reset_cpu_tensor_peak();
  two_ranks([](std::shared_ptr<Group> g) {
    at::Tensor mine = at::ones({1 << 19}), all = at::empty({1 << 20});
    g->all_gather(all, mine, "an all-gather");
  });
  const std::int64_t grew = cpu_tensor_memory().peak - base, inputs_and_outputs = 2 * (2 << 20) + 2 * (4 << 20);
  EXPECT_GE(grew, inputs_and_outputs);
  EXPECT_LT(grew, inputs_and_outputs + (1 << 20)) << "an all-gather held more than its input and output";
}

// Sharded, each bucket's whole-length buffer goes during the backward, once
// its reduce-scatter is waited for: with eight buckets launched, no more than
// kInFlight exist at once (before, every one lived to finish(): the whole
// gradient on every rank), and the sums are still the two ranks' own.
TEST(GradReducer, ShardedBucketsHoldAtMostAFewWholeBuffersDuringTheBackward) {
  for (auto mode : {ShardMode::Optimizer, ShardMode::Gradients}) {
    two_ranks([&](std::shared_ptr<Group> g) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
      std::vector<at::Tensor> w;
      for (int k = 0; k < 8; ++k) w.push_back((at::randn({64, 64}, gen) * 0.2).requires_grad_());
      GradReducer red(g, w, /*bucket_mb=*/0.01, mode);
      ASSERT_EQ(red.buckets(), 8u);
      auto loss_of = [&](const std::vector<at::Tensor>& ws, int rank) {
        at::Tensor x = at::full({4, 64}, static_cast<double>(rank + 1));
        for (const auto& p : ws) x = at::tanh(x.mm(p));
        return x.sum();
      };
      red.arm();
      loss_of(w, g->rank()).backward();
      EXPECT_GE(red.launched_during_backward(), 7u);
      red.finish(1);
      EXPECT_GE(red.most_in_flight(), 1u);
      EXPECT_LE(red.most_in_flight(), GradReducer::kInFlight);
      std::vector<at::Tensor> ref;
      for (auto& p : w) ref.push_back(p.detach().clone().requires_grad_());
      (loss_of(ref, 0) + loss_of(ref, 1)).backward();
      for (const auto& piece : red.my_pieces()) {
        const at::Tensor want = ref[piece.param].grad().reshape({-1}).narrow(0, piece.start, piece.numel);
        EXPECT_TRUE(at::allclose(red.piece_grad(piece), want, 1e-5, 1e-6));
      }
    });
  }
}

// The oldest buffer goes when a bucket beyond kInFlight needs room, not as
// soon as its reduce-scatter happens to be done: a backward that leaves
// every reduce-scatter time to finish before the next bucket (a pause in a
// gradient hook) holds as many buffers at once as one that leaves none, so
// a step's peak does not move with the collectives' timing. (Freed as soon
// as they were done, the paused backward held one at a time where the other
// held two, and `wick plan`'s peaks moved with the machine's load.)
TEST(GradReducer, TheBuffersHeldDuringTheBackwardDoNotDependOnWhenTheReduceScattersFinish) {
  for (auto mode : {ShardMode::Optimizer, ShardMode::Gradients}) {
    for (bool pause : {false, true}) {
      two_ranks([&](std::shared_ptr<Group> g) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
        std::vector<at::Tensor> w;
        for (int k = 0; k < 6; ++k) w.push_back((at::randn({64, 64}, gen) * 0.2).requires_grad_());
        GradReducer red(g, w, /*bucket_mb=*/0.01, mode);
        ASSERT_EQ(red.buckets(), 6u);
        at::Tensor x = at::full({4, 64}, static_cast<double>(g->rank() + 1));
        for (auto& p : w) {
          x = at::tanh(x.mm(p));
          // the gradient of this layer's output: the previous bucket's reduce-scatter has 50 ms to finish
          if (pause) x.register_hook([](const at::Tensor&) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
        }
        red.arm();
        x.sum().backward();
        red.finish(1);
        EXPECT_EQ(red.launched_during_backward(), 6u);
        EXPECT_EQ(red.most_in_flight(), GradReducer::kInFlight) << (pause ? "with" : "without") << " pauses";
      });
    }
  }
}

TEST(GradReducer, ShardedPiecesTileEveryParameterOnceAtAlignedStartsAndTakeTheReducedGradients) {
  for (double bucket_mb : {25.0, 0.02}) {
    two_ranks([&](std::shared_ptr<Group> g) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
      // the model's order: 5000, 9000, 3 and 10800 elements
      std::vector<at::Tensor> w{(at::randn({50, 100}, gen) * 0.1).requires_grad_(),
                                (at::randn({100, 90}, gen) * 0.1).requires_grad_(), at::randn({3}, gen).requires_grad_(),
                                (at::randn({90, 10, 2, 2, 3, 1, 1}, gen) * 0.1).requires_grad_()};
      GradReducer red(g, w, bucket_mb, ShardMode::Gradients);
      std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> covered(w.size());
      for (int rank = 0; rank < 2; ++rank) {
        std::set<std::size_t> seen;
        for (const auto& p : red.pieces(rank)) {
          EXPECT_EQ(p.start % kShardAlign, 0);
          EXPECT_TRUE(seen.insert(p.param).second) << "two pieces of one parameter on one rank";
          covered[p.param].emplace_back(p.start, p.numel);
        }
      }
      for (std::size_t k = 0; k < w.size(); ++k) {
        std::sort(covered[k].begin(), covered[k].end());
        std::int64_t next = 0;
        for (auto [start, n] : covered[k]) {
          EXPECT_EQ(start, next);
          next = start + n;
        }
        EXPECT_EQ(next, w[k].numel());
      }
      auto loss_of = [&](int rank) {
        at::Tensor x = at::full({2, 50}, static_cast<double>(rank + 1));
        x = at::tanh(x.mm(w[0]));
        x = at::tanh(x.mm(w[1])).sum(1, true) * w[2].sum() + w[3].sum();
        return x.sum();
      };
      red.arm();
      loss_of(g->rank()).backward();
      red.finish(1);
      for (auto& p : w) EXPECT_FALSE(p.grad().defined());  // ZeRO-2: only the pieces' sums remain
      std::vector<at::Tensor> ref;
      for (auto& p : w) ref.push_back(p.detach().clone().requires_grad_());
      std::swap(w, ref);
      (loss_of(0) + loss_of(1)).backward();
      std::swap(w, ref);
      for (const auto& piece : red.my_pieces()) {
        const at::Tensor want = ref[piece.param].grad().reshape({-1}).narrow(0, piece.start, piece.numel);
        EXPECT_TRUE(at::allclose(red.piece_grad(piece), want, 1e-5, 1e-6));
      }
      // each rank changes its pieces; the all-gather puts every change everywhere
      for (const auto& piece : red.my_pieces()) red.piece_view(piece).add_(10.0 * (g->rank() + 1));
      red.gather_params(1);
      for (int rank = 0; rank < 2; ++rank)
        for (const auto& piece : red.pieces(rank)) {
          const at::Tensor got = w[piece.param].detach().reshape({-1}).narrow(0, piece.start, piece.numel);
          const at::Tensor was = ref[piece.param].detach().reshape({-1}).narrow(0, piece.start, piece.numel);
          EXPECT_TRUE(at::allclose(got, was + 10.0 * (rank + 1)));
        }
    });
  }
}

// ZeRO-3 divides a unit's frozen tensors (a LoRA's base, QLoRA's 4-bit
// codes) as the bytes of a buffer of their own: each rank keeps half, a
// gather brings every byte back (any dtype), the trainable part reduces as
// before, and a unit with frozen tensors is freed only once the gradient of
// its block's input is in too (its own gradients cannot say the backward is over).
TEST(GradReducer, ParametersDivideFrozenTensorsOfAnyDtypeAndFreeThemAfterTheInputsGradient) {
  two_ranks([](std::shared_ptr<Group> g) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    at::Tensor w = (at::randn({64, 64}, gen) * 0.2).requires_grad_();
    at::Tensor f = at::randn({64, 48}, gen) * 0.2;             // a frozen float weight
    at::Tensor codes = at::randint(0, 256, {1000}, gen).to(at::kByte);  // 4-bit codes, as bytes
    at::Tensor scale = at::randn({7}, gen).to(at::kDouble);    // a constant of another element size
    const at::Tensor f0 = f.clone(), codes0 = codes.clone(), scale0 = scale.clone();
    const std::int64_t frozen_bytes = f.nbytes() + codes.nbytes() + scale.nbytes();
    GradReducer red(g, {w}, 25, ShardMode::Parameters, {{0}}, at::ScalarType::Undefined, {{f, codes, scale}});
    ASSERT_EQ(red.units(), 1u);
    EXPECT_TRUE(red.has_frozen(0));
    EXPECT_EQ(red.unit_storages(0).size(), 2u);  // the trainable buffer and the frozen one
    EXPECT_EQ(red.unit_storages(0)[1], f.storage().unsafeGetStorageImpl());
    EXPECT_EQ(red.unit_storages(0)[1], codes.storage().unsafeGetStorageImpl());
    EXPECT_EQ(red.whole_weight_bytes(), static_cast<std::int64_t>(w.nbytes()) + frozen_bytes);
    EXPECT_TRUE(at::equal(f, f0) && at::equal(codes, codes0) && at::equal(scale, scale0));
    red.release_all();
    // each rank: half of each buffer. The trainable one: w's 4096 elements
    // padded to 2 x 4096 (16 KiB a rank); the frozen one: f's 12288 bytes,
    // the codes' 1000 at 12288, the scales' 56 at 13312 (a multiple of 64),
    // padded to 13440 (6720 a rank)
    const std::int64_t held = red.held_weight_bytes();
    EXPECT_EQ(held, 4096 * 4 + 6720);
    EXPECT_LT(held, red.whole_weight_bytes());
    red.gather_unit(0, "test");
    EXPECT_TRUE(at::equal(f, f0) && at::equal(codes, codes0) && at::equal(scale, scale0));
    EXPECT_EQ(red.held_weight_bytes(), held + 8192 * 4 + 13440);

    // a backward: every gradient of the unit comes in and its reduce-scatter
    // leaves, but until the gradient of the block's input is reported the
    // frozen weights may still be read, so the unit stays gathered
    at::Tensor x = at::full({4, 64}, static_cast<double>(g->rank() + 1));
    red.arm();
    (at::tanh(x.mm(w)).mm(f).sum() * scale[0]).backward();
    EXPECT_EQ(red.held_weight_bytes(), held + 8192 * 4 + 13440);
    red.input_grad_ready(0);
    EXPECT_EQ(red.held_weight_bytes(), held);
    red.finish(1);
    // the trainable part: this rank's piece of the sum of both ranks' gradients
    red.gather_unit(0, "reference");
    at::Tensor wr = w.detach().clone().requires_grad_();
    red.release_all();
    at::Tensor total = at::zeros({}, at::kDouble);
    for (int rank = 0; rank < 2; ++rank)
      total = total + at::tanh(at::full({4, 64}, static_cast<double>(rank + 1)).mm(wr)).mm(f0).sum() * scale0[0];
    total.backward();
    for (const auto& piece : red.my_pieces())
      EXPECT_TRUE(at::allclose(red.piece_grad(piece), wr.grad().reshape({-1}).narrow(0, piece.start, piece.numel),
                               1e-5, 1e-6));
    red.make_unit(0);  // no collective: each rank about to fill it alike
    // weights written into a gathered unit (a checkpoint read) are kept as this rank's chunks
    {
      at::NoGradGuard no_grad;
      f.fill_(0.5);
      codes.fill_(7);
      scale.fill_(2.0);
    }
    red.keep_chunks_of_gathered();
    red.release_all();
    red.gather_unit(0, "test");
    EXPECT_TRUE(at::equal(f, at::full_like(f0, 0.5)) && at::equal(codes, at::full_like(codes0, 7)));
    EXPECT_TRUE(at::equal(scale, at::full_like(scale0, 2.0)));
    red.release_all();
    // the end of training: every unit whole for good, its frozen chunk dropped
    red.gather_all("the end", /*last=*/true);
    EXPECT_EQ(red.held_weight_bytes(), 4096 * 4 + 8192 * 4 + 13440);
    red.release_all();  // no longer frees anything
    EXPECT_TRUE(at::equal(f, at::full_like(f0, 0.5)));
  });
}

// A deferred model's value arrives in the dtype it was made or stored in (a
// bf16 file for an fp32 model): each rank converts only the elements whose
// bytes fall in its chunks, and a gather gives the value in each tensor's dtype.
TEST(GradReducer, FillKeepsThisRanksBytesOfAValueInAnotherDtype) {
  two_ranks([](std::shared_ptr<Group> g) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor w = at::randn({64, 64}, gen).requires_grad_();
    at::Tensor f = at::randn({64, 48}, gen).to(at::kBFloat16);
    at::Tensor codes = at::randint(0, 256, {1000}, gen).to(at::kByte);
    at::Tensor scale = at::randn({7}, gen).to(at::kDouble);
    GradReducer red(g, {w}, 25, ShardMode::Parameters, {{0}}, at::ScalarType::Undefined, {{f, codes, scale}});
    red.release_all();
    const at::Tensor wv = at::randn({64, 64}, gen).to(at::kDouble), fv = at::randn({64, 48}, gen),
                     cv = at::randint(0, 256, {1000}, gen), sv = at::randn({7}, gen);  // fp64, fp32, int64, fp32
    EXPECT_TRUE(red.fill(w, wv));
    EXPECT_TRUE(red.fill(f, fv));
    EXPECT_TRUE(red.fill(codes, cv));
    EXPECT_TRUE(red.fill(scale, sv));
    EXPECT_FALSE(red.fill(at::zeros({3}), at::zeros({3})));  // not the unit's
    red.gather_unit(0, "test");
    EXPECT_TRUE(at::equal(w.detach(), wv.to(at::kFloat)));
    EXPECT_TRUE(at::equal(f, fv.to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(codes, cv.to(at::kByte)));
    EXPECT_TRUE(at::equal(scale, sv.to(at::kDouble)));
    red.release_all();
  });
}

// A deferred 4-bit weight made in parts (fill_nf4): each rank is given a
// weight whose values are NaN except where it may read (the values its
// packed codes come from, and its even share of the blocks for the absmax
// constants); gathered, the unit holds the bits nf4_quantize gives the whole
// true weight. Tensors ahead of the 4-bit ones in the unit move the chunks'
// edges through them.
TEST(GradReducer, Nf4WeightMadeInPartsUsesOnlyEachRanksValuesAndGivesTheWholeWeightsBits) {
  for (int world : {2, 3})
    for (std::int64_t lead : {1, 3001, 7777})
      ranks(world, [&](std::shared_ptr<Group> g) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
        // rows of different scales, so the block constants differ and their mean matters
        const at::Tensor truth = (at::randn({160, 256}, gen) * at::rand({160, 1}, gen) * 3).to(at::kBFloat16);
        const std::int64_t n = truth.numel(), blocks = n / 64;
        at::Tensor p = at::randn({8, 8}, gen).requires_grad_();
        at::Tensor ahead = at::randint(0, 256, {lead}, gen).to(at::kByte);
        const at::Tensor before = ahead.clone();
        Nf4Weight h = nf4_hollow({160, 256});
        GradReducer red(g, {p}, 25, ShardMode::Parameters, {{0}}, at::ScalarType::Undefined,
                        {{ahead, h.packed, h.absmax_q, h.absmax_scale, h.absmax_offset}});
        red.release_all();
        const auto [a, z] = *red.kept(h.packed);
        EXPECT_LT(z - a, n / 2);  // no rank keeps every code
        const std::int64_t share = (blocks + world - 1) / world, b0 = std::min(blocks, g->rank() * share),
                           b1 = std::min(blocks, b0 + share);
        at::Tensor w = at::full({160, 256}, NAN, at::kBFloat16);
        for (auto [s, e] : {std::pair{2 * a, 2 * z}, {b0 * 64, b1 * 64}})
          w.view({-1}).narrow(0, s, e - s).copy_(truth.view({-1}).narrow(0, s, e - s));
        ASSERT_TRUE(fill_nf4(red, *g, h, w));
        EXPECT_FALSE(fill_nf4(red, *g, nf4_hollow({4, 64}), at::zeros({4, 64})));  // not the unit's
        red.gather_unit(0, "test");
        const Nf4Weight ref = nf4_quantize(truth);
        EXPECT_TRUE(at::equal(h.packed, ref.packed)) << world << " ranks, " << lead << " bytes ahead";
        EXPECT_TRUE(at::equal(h.absmax_q, ref.absmax_q));
        EXPECT_TRUE(at::equal(h.absmax_scale, ref.absmax_scale));
        EXPECT_TRUE(at::equal(h.absmax_offset, ref.absmax_offset));
        EXPECT_TRUE(at::equal(ahead, before));  // its neighbour's bytes untouched
        red.release_all();
      });
}

}  // namespace
}  // namespace wick
