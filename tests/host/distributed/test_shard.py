"""Sharded optimizer state and gradients (ZeRO-1 and ZeRO-2) and weights
(ZeRO-3) over gloo ranks: the same weights as one rank with the same effective
batch, each rank holding its part of the optimizer state (and of the reduced
gradients, and of the weights), reduce-scatter and all-gather sending what one
all-reduce sends, checkpoints that stay one rank's and resume with another
rank count and another shard setting."""
import os
import re
import shutil
import subprocess
import time

import torch

import pytest
from safetensors.torch import load_file

from conftest import WICK  # tests/conftest.py

# A model whose larger weights (8192 and 12288 elements) are cut across ranks
# at multiples of 4096 elements, and buckets small enough that there are several.
RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = a.size or 96, inputs = a.inputs or 64, classes = 3, max_items = 3, seed = 4 })
wick.seed(5)
local model = wick.model("mlp", { inputs = a.inputs or 64, hidden = { a.hidden or 128, 96 }, outputs = 3 })
local optims = {
  adamw = function() return wick.optim("adamw", { lr = 0.01, weight_decay = 0.05 }) end,
  sgd = function() return wick.optim("sgd", { lr = 0.05, momentum = 0.9 }) end,
  adamw8bit = function() return wick.optim("adamw8bit", { lr = 0.01 }) end,
  groups = function() return wick.optim("adamw", { lr = 0.01, groups = { { params = "bias", weight_decay = 0, lr = 0.02 } } }) end,
  unit_step = function() return wick.optim("unit_step", { lr = 0.01 }) end,
  unit_group = function() return wick.optim("unit_step", { lr = 0.01, groups = { { params = "bias", lr = 0.02 } } }) end,
}
local run = wick.train { model = model, data = data, optim = optims[a.optim or "adamw"](),
  schedule = a.schedule or "cosine", warmup_steps = 2, micro_batch = a.micro, accumulate = a.acc, epochs = a.epochs or 2,
  max_steps = a.max_steps or 0, seed = 9, clip_grad_norm = a.clip or 0.5, clip_grad_value = a.clip_value or 0,
  quiet = not a.loud, bucket_mb = a.bucket_mb or 25, shard = a.shard or "none", out = a.out, resume = a.resume or false,
  save_every = a.save_every or 0, checkpointing = a.ck or false, precision = a.precision or "fp32",
  master_weights = a.masters or false, ema = a.ema or 0, eval_data = a.eval and data or nil, eval_every = a.eval or 0,
  eval_ema = a.eval_ema or false,
  callbacks_every_rank = a.die_at ~= nil or a.peek ~= nil,
  on_step = (a.die_at or a.peek) and function(rec)
    if a.die_at and wick.rank == 1 and rec.step == a.die_at then os.exit(3) end
    if a.peek and rec.step == a.peek then model:save(a.result .. ".peek") end
  end or nil }
if wick.rank == 0 then model:save(a.result) end
if run.eval then print(string.format("EVAL %d %.9f %.9f", wick.rank, run.eval.loss, run.eval.ema_loss or 0)) end
print("WEIGHTS " .. wick.rank .. " " .. run.memory.weights .. " " .. run.memory.peak)
print(string.format("PEAKS %d %d %d %d", wick.rank, run.memory.start_peak, run.memory.end_peak, run.memory.run_peak))
print(string.format("rank %d steps %d loss %.9f", wick.rank, run.steps, run.final_loss))
print("MASTERS " .. wick.rank .. " " .. run.memory.master_weights)
print("RESULT " .. wick.rank .. " " .. string.format("%d %d %d %d", run.memory.optimizer, run.memory.gradients,
  run.comm.sent, run.comm.bytes))
"""


@pytest.fixture
def recipe(tmp_path):
    p = tmp_path / "recipe.lua"
    p.write_text(RECIPE)
    return p


def assert_same_weights(a, b, rtol=1e-5):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert set(wa) == set(wb)
    for k in wb:  # in float: 4-bit codes are bytes; an all-zero tensor must match exactly
        d, m = (wa[k].float() - wb[k].float()).abs().max().item(), wb[k].float().abs().max().item()
        assert d <= rtol * m, f"{k}: difference {d} against largest {m}"


def assert_same_entries(a, b):
    """Two safetensors files with the same names, dtypes and bits."""
    mine, theirs = load_file(str(a)), load_file(str(b))
    assert set(mine) == set(theirs)
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), (a, k)
    return mine


def evals_of(stdout):
    """Each rank's EVAL line: [loss, loss with the average], as printed."""
    return [l.split()[2:] for l in stdout.replace("[rank 1] ", "").replace("[rank 2] ", "").splitlines()
            if l.startswith("EVAL ")]


def results(stdout):
    """rank -> (optimizer bytes, gradient bytes, bytes sent, bytes given) at the run's end."""
    out = {}
    for line in stdout.replace("[rank 1] ", "").replace("[rank 2] ", "").splitlines():
        if line.startswith("RESULT "):
            r, *v = line.split()[1:]
            out[int(r)] = tuple(int(x) for x in v)
    return out


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("nproc,optim,extra", [
    (2, "adamw", []),
    (3, "adamw", ["bucket_mb=0.05"]),        # several buckets, 3 uneven chunks
    (2, "sgd", ["bucket_mb=0.05"]),          # momentum buffers cut with the weights
    (3, "sgd", []),
    (2, "adamw8bit", ["clip=0"]),            # 8-bit blocks line up with the pieces
    (3, "adamw8bit", ["bucket_mb=0.05", "clip=0"]),
    (2, "groups", ["clip_value=0.02"]),      # parameter groups, and clamped gradients
    (2, "adamw", ["ck=true"]),               # recomputed blocks in the backward that reduces
    (3, "sgd", ["size=100"]),                # each epoch's last window: 4 samples, none on rank 2
])
def test_sharded_ranks_end_where_one_rank_with_the_same_effective_batch_ends(tmp_path, recipe, run_wick, shard, nproc,
                                                                             optim, extra):
    many, one, plain = tmp_path / "many.safetensors", tmp_path / "one.safetensors", tmp_path / "plain.safetensors"
    micro, acc = 2, 2
    p = run_wick("launch", "--nproc-per-node", nproc, recipe, f"micro={micro}", f"acc={acc}", f"optim={optim}",
                 f"shard={shard}", f"result={many}", *extra)
    steps = int(p.stdout.split("rank 0 steps ")[1].split()[0])
    assert steps >= 8
    run_wick("run", recipe, f"micro={micro * acc * nproc}", "acc=1", f"optim={optim}", f"result={one}", *extra)
    if optim == "adamw8bit":
        # 8-bit moments round a gradient that differs in its last bits (the
        # sum's order across ranks, a norm summed from pieces) to another code
        # now and then: without clipping, against the same ranks unsharded,
        # the same gradients must give the same codes in the pieces' blocks
        if shard == "parameters" and nproc == 2:
            # ZeRO-3 reduces every micro-batch, so its window's sums are
            # (a + c) + (b + d), not (a + b) + (c + d), and its buffers are
            # laid out by block (on 3 ranks a ring sums an element's three
            # parts in an order that follows the layout): the same codes only
            # with one micro-batch on each of two ranks
            same = ["micro=4", "acc=1"]
            run_wick("launch", "--nproc-per-node", nproc, recipe, *same, f"optim={optim}", f"shard={shard}",
                     f"result={tmp_path / 'many1.safetensors'}", *extra)
            run_wick("launch", "--nproc-per-node", nproc, recipe, *same, f"optim={optim}", f"result={plain}", *extra)
            assert_same_weights(tmp_path / "many1.safetensors", plain)
        elif shard != "parameters":
            run_wick("launch", "--nproc-per-node", nproc, recipe, f"micro={micro}", f"acc={acc}", f"optim={optim}",
                     f"result={plain}", *extra)
            # on 3 ranks with several buckets the sums' order differs too: over
            # the recipe's seeds shifted by k = 0, 1, 2 (OMP_NUM_THREADS=1,
            # Sapphire Rapids) 7.1e-7, 7.5e-6 and 4.2e-5, a code parting, which
            # failed the bound 1e-5 of the 2-rank case: the same codes hold on 2
            # ranks only, and 3 get the bound against one rank below
            assert_same_weights(many, plain, rtol=6e-3 if nproc == 3 else 1e-5)
        # against one rank, the codes part now and then: 2.2e-3 on an AVX-512
        # CPU (whose products round otherwise), under 2e-3 on AVX2 ones; over
        # the seeds shifted by k = 0, 1, 2: 2.24e-3, 7.2e-4, 2.85e-3 (the old
        # bound 3e-3; avx2 gave 2.24e-3 at k = 0 too) on a Xeon; on an AMD
        # EPYC (Zen 4), wick.seed and seed + 100 k, k = 1..5, default kernels
        # and avx2, up to 7.9e-3 on 2 ranks (k = 1; the bound was 6e-3) and
        # 1.7e-3 on 3
        assert_same_weights(many, one, rtol=2e-2)
    else:
        # one rank sums its batch in another order, which AdamW carries on:
        # on an AMD EPYC (Zen 4), wick.seed and seed + 100 k, k = 1..5,
        # default kernels and avx2, up to 9.2e-6 of a tensor's largest value
        # (2 ranks, k = 1; the bound was 1e-5), 7.7e-6 with groups and on 3
        # ranks
        assert_same_weights(many, one, rtol=5e-5)


def test_each_rank_holds_its_part_of_the_optimizer_state_and_gradients(tmp_path, recipe, run_wick):
    """Per rank: optimizer state and, at the step, the reduced gradients 1/N
    of the unsharded ones (within one alignment unit per bucket); bytes sent
    equal (the all-reduce is a reduce-scatter and an all-gather) up to the
    alignment's zeros."""
    args = ["micro=2", "acc=2", "epochs=1"]
    figures = {}
    for shard in ["none", "optimizer", "gradients"]:
        p = run_wick("launch", "--nproc-per-node", 2, recipe, *args, f"shard={shard}",
                     f"result={tmp_path / (shard + '.safetensors')}")
        figures[shard] = results(p.stdout)
    none_opt, none_grad = figures["none"][0][0], figures["none"][0][1]
    params = none_grad // 4  # fp32 gradients: one per trainable element
    assert none_opt == 2 * none_grad + 6 * 4  # AdamW's two moments and a step count per parameter, on every rank
    for shard in ["optimizer", "gradients"]:
        opt = [figures[shard][r][0] for r in range(2)]
        # every moment kept once, on one rank (a cut parameter's step count on each rank holding a piece)
        assert 0 <= sum(opt) - none_opt <= 6 * 4, (shard, opt)
        assert max(opt) <= none_opt / 2 * 1.05 + 2 * 4 * 4096, (shard, opt)
    for shard in ["optimizer", "gradients"]:
        grads = [figures[shard][r][1] for r in range(2)]
        assert sum(grads) == none_grad, (shard, grads)  # each rank only its reduced pieces at the step
    # wire bytes: the gradient reduce-scatter and the weights' all-gather send
    # what the all-reduce sends, plus the alignment's zeros (at most N x 4096
    # elements per parameter and bucket) and a norm each step
    sent_none, sent_z2 = figures["none"][0][2], figures["gradients"][0][2]
    steps = 96 // 8
    assert sent_z2 >= sent_none * 0.99
    assert sent_z2 <= sent_none + steps * 2 * (6 * 4096 * 4 + 64), (sent_none, sent_z2, params)


def masters(stdout):
    """rank -> bytes of fp32 master weights it held at the run's end."""
    return {int(l.split()[1]): int(l.split()[2]) for l in stdout.replace("[rank 1] ", "").replace("[rank 2] ", "")
            .splitlines() if l.startswith("MASTERS ")}


def assert_masters_divided(held, whole):
    """Two sharded ranks' master bytes against two unsharded ranks': the
    pieces tile the parameters, neither rank holds over half plus the
    alignment."""
    assert whole[0] == whole[1] > 0
    assert held[0] + held[1] == whole[0]
    assert max(held.values()) <= whole[0] / 2 + 4096 * 4 * 2, (held, whole)


def weights_and_peaks(stdout):
    """rank -> (weight bytes, step peak bytes) at the run's end."""
    out = {}
    for line in stdout.replace("[rank 1] ", "").replace("[rank 2] ", "").splitlines():
        if line.startswith("WEIGHTS "):
            r, w, peak = (int(x) for x in line.split()[1:])
            out[r] = (w, peak)
    return out


@pytest.mark.parametrize("nproc", [2, 3])
def test_parameters_divide_the_weights_too(tmp_path, recipe, run_wick, nproc):
    """shard = "parameters" (ZeRO-3): per rank, weights + gradients +
    optimizer state are 1/N of one unsharded rank's (within 5%: the alignment
    of each block's chunks) at the step, the ranks' weight bytes add up to the
    whole model's plus the alignment, and the step's peak falls with them;
    the bytes sent add the weights' gathers (forward and backward) to the
    gradients' reduce-scatter."""
    args = ["micro=2", "acc=2", "epochs=1", "inputs=512", "hidden=1024", "clip=0"]
    got = {}
    for shard in ["none", "parameters"]:
        p = run_wick("launch", "--nproc-per-node", nproc, recipe, *args, f"shard={shard}",
                     f"result={tmp_path / (shard + '.safetensors')}")
        got[shard] = (results(p.stdout), weights_and_peaks(p.stdout))
        steps = int(p.stdout.split("rank 0 steps ")[1].split()[0])
    (none_res, none_w) = got["none"]
    (z3_res, z3_w) = got["parameters"]
    whole = none_w[0][0] + none_res[0][1] + none_res[0][0]  # weights + gradients + optimizer, one rank unsharded
    for r in range(nproc):
        state = z3_w[r][0] + z3_res[r][1] + z3_res[r][0]
        assert state <= whole / nproc * 1.05, (r, state, whole)
        assert z3_w[r][1] < none_w[r][1], (r, z3_w[r][1], none_w[r][1])  # the step's peak
    total = sum(z3_w[r][0] for r in range(nproc))
    assert none_w[0][0] <= total <= none_w[0][0] * 1.05, (total, none_w[0][0])
    # bytes sent: each of a window's 2 micro-batches gathers the weights twice
    # and reduce-scatters the gradients, 3 x 2 x (N-1)/N of them, against the
    # all-reduce's 2 (N-1)/N once: 3x, plus the alignment and the small checks,
    # and once a run the one-sample micro-batch its first window starts with
    # (on_oom = "split": to know the collectives a micro-batch issues)
    micro_batches = 2 * steps
    per_step = z3_res[0][2] * micro_batches / (micro_batches + 1)
    assert 2.9 < per_step / none_res[0][2] < 3.3, (z3_res[0][2], none_res[0][2])
    print(f"{nproc} ranks: state per rank {max(z3_w[r][0] + z3_res[r][1] + z3_res[r][0] for r in range(nproc)) / 2**20:.2f}"
          f" MiB against {whole / 2**20:.2f} MiB unsharded; peak {max(v[1] for v in z3_w.values()) / 2**20:.2f} MiB"
          f" against {max(v[1] for v in none_w.values()) / 2**20:.2f}; sent {z3_res[0][2]} B against {none_res[0][2]} B")
    # the sums in another order (each micro-batch reduced), which AdamW enlarges on this wider model
    assert_same_weights(tmp_path / "parameters.safetensors", tmp_path / "none.safetensors", rtol=5e-5)


def test_parameters_evaluate_and_checkpoint_the_whole_weights(tmp_path, recipe, run_wick):
    """Evaluation under shard = "parameters" gathers each block's weights as
    training does (the loss equals the unsharded ranks'), checkpoints hold the
    whole model on rank 0, and a callback that reads the model while its
    weights are divided is refused by name (no read of freed memory)."""
    common = ["--nproc-per-node", 2, recipe, "micro=2", "acc=2", "epochs=1", "eval=3"]
    p = run_wick("launch", *common, "shard=parameters", f"out={tmp_path / 'z3'}", "save_every=3",
                 f"result={tmp_path / 'z3.safetensors'}")
    q = run_wick("launch", *common, f"out={tmp_path / 'plain'}", "save_every=3", f"result={tmp_path / 'plain.safetensors'}")
    evals = [re.findall(r"EVAL (\d) ([\d.]+)", x.stdout.replace("[rank 1] ", "")) for x in (p, q)]
    assert len(evals[0]) == 2 and evals[0][0][1] == evals[0][1][1], evals  # both ranks, the same loss
    assert abs(float(evals[0][0][1]) - float(evals[1][0][1])) < 1e-6, evals
    ck = "checkpoints/step-00000006"
    assert_same_weights(tmp_path / "z3" / ck / "model.safetensors", tmp_path / "plain" / ck / "model.safetensors")
    r = run_wick("launch", *common, "shard=parameters", "peek=2", f"result={tmp_path / 'peek.safetensors'}", check=False)
    assert r.returncode != 0
    assert "save: the model cannot be used now: its weights are divided across the ranks" in r.stderr, r.stderr
    assert "Exception raised from" not in r.stderr
    assert not (tmp_path / "peek.safetensors.peek").exists()


LOST = """
local wick = require "wick"
local data = wick.data("synthetic", { size = 96, inputs = 64, classes = 3 })
local model = wick.model("mlp", { inputs = 64, hidden = { 128, 96 }, outputs = 3 })
local t = { model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 2, accumulate = 2,
  quiet = true, shard = "parameters", callbacks_every_rank = true,
  on_step = function(rec) if rec.step == 2 then error("stop here") end end }
print("first", pcall(wick.train, t))
print("save", pcall(function() model:save(wick.args.dest) end))
t.on_step = nil
print("again", pcall(wick.train, t))
"""


def test_a_run_that_fails_under_parameters_leaves_a_model_that_says_so(tmp_path, run_wick):
    """A recipe that catches a failed shard = "parameters" run (its weights
    still divided) and then saves or trains the model again gets an error
    naming why on every rank, not a read of freed memory."""
    (tmp_path / "l.lua").write_text(LOST)
    p = run_wick("launch", "--nproc-per-node", 2, tmp_path / "l.lua", f"dest={tmp_path / 'x.safetensors'}")
    lines = p.stdout.replace("[rank 1] ", "").splitlines()

    def said(what, message):
        return sum(1 for l in lines if l.startswith(what + "\tfalse\t") and message in l)
    assert said("first", "stop here") == 2, lines
    assert said("save", "save: the model cannot be used now: its trainer ended while its weights were divided") == 2, lines
    assert said("again", "wick.train: the model cannot be trained: its trainer ended while its weights") == 2, lines
    assert not (tmp_path / "x.safetensors").exists()


ADAPTED = """
local wick = require "wick"
local a = wick.args
wick.seed(3)
local hidden = tonumber(a.hidden or 64)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = hidden, intermediate_size = 2 * hidden,
  layers = 3, heads = 4 })
local data = wick.data("text", { file = a.data, max_length = 24, cache_dir = "none" })
wick.optim(a.kind, a.kind == "qlora" and { r = 4, compute_dtype = "fp32" } or { r = 4 }):apply(model)
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }),
  micro_batch = tonumber(a.micro), accumulate = tonumber(a.acc), epochs = 2, shuffle = false, quiet = true, seed = 1,
  shard = a.shard or "none", checkpointing = a.ck ~= "false", out = a.out, save_every = tonumber(a.save_every or 0),
  max_steps = tonumber(a.max_steps or 0), resume = a.resume == "true" }
if wick.rank == 0 then model:save(a.result) end
print("WEIGHTS " .. wick.rank .. " " .. run.memory.weights .. " " .. run.memory.peak)
"""


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_parameters_with_adapters_divide_the_adapters_and_equal_one_rank(tmp_path, run_wick, kind):
    """LoRA and QLoRA (NF4 base) under shard = "parameters": only the
    adapters train, so only they are divided (the frozen base stays whole on
    every rank), each block's adapters gathered as it runs, under
    checkpointing; the trained weights equal one rank's."""
    import random
    rnd = random.Random(5)
    words = ["red", "circle", "moves", "blue", "square", "up", "down", "left", "a", "the", "slowly", "fast"]
    (tmp_path / "d.jsonl").write_text("".join('{"text": "%s"}\n' % " ".join(rnd.choice(words) for _ in range(12))
                                              for _ in range(48)))
    (tmp_path / "a.lua").write_text(ADAPTED)
    many, one = tmp_path / "many.safetensors", tmp_path / "one.safetensors"
    common = [f"data={tmp_path / 'd.jsonl'}", f"kind={kind}"]
    # one micro-batch per rank: the sums a + b, as one rank's (AdamW enlarges another order's last bits)
    run_wick("launch", "--nproc-per-node", 2, tmp_path / "a.lua", *common, "micro=4", "acc=1", "shard=parameters",
             f"result={many}")
    run_wick("launch", "--nproc-per-node", 2, tmp_path / "a.lua", *common, "micro=4", "acc=1",
             f"result={tmp_path / 'plain.safetensors'}")
    run_wick("run", tmp_path / "a.lua", *common, "micro=8", "acc=1", f"result={one}")

    def close(a, b, rtol):
        wa, wb = load_file(str(a)), load_file(str(b))
        assert any("lora_A" in k for k in wb)
        for k in wb:
            d = (wa[k].float() - wb[k].float()).abs().max().item()
            assert d <= rtol * wb[k].float().abs().max().item() + 1e-9, (k, d)
    close(many, tmp_path / "plain.safetensors", 1e-6)  # the same ranks unsharded: the same sums
    # One rank's batch of 8: one product where the ranks sum two. AdamW's
    # step is lr * m / sqrt(v): a gradient element that sums to nearly zero
    # takes a whole step of either sign on its last bits, and the steps after
    # carry it on, so the largest element apart is no measure here. Measured
    # over the recipe's seeds (wick.seed and seed shifted by 100 k, k = 0..11;
    # lora and qlora; default kernels and ATEN_CPU_CAPABILITY=avx2;
    # OMP_NUM_THREADS=1) on an AMD EPYC (Zen 4), 48 runs: the largest element
    # apart reached 0.030 of the tensor's largest (lora k = 11; 7 runs over
    # the old bound 1.5e-3, set from 18 runs on a Xeon, worst 4.7e-4), while
    # the difference's 2-norm against the tensor's stayed at or under 6.4e-3
    # (median 3.4e-5; 8.9e-5 at most for the shipped seed). One rank's
    # micro-batches alone (batches of 4 instead of 8) put every adapter 0.365
    # or more apart by that norm (24 runs).
    wa, wb = load_file(str(many)), load_file(str(one))
    for k in wb:
        apart = ((wa[k].float() - wb[k].float()).norm() / wb[k].float().norm().clamp_min(1e-12)).item()
        assert apart <= 2e-2, (k, apart)


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_parameters_divide_the_frozen_base_of_adapters_too(tmp_path, run_wick, kind):
    """LoRA and QLoRA under shard = "parameters" divide the frozen base (the
    bf16/fp32 weights, the 4-bit codes and their constants) as they divide
    the adapters (FSDP-QLoRA): each of 2 ranks holds about half of one
    unsharded rank's weight bytes (and the adapters' alignment), together all
    of them; with and without
    checkpointing the trained adapters equal the unsharded ranks', and a
    run saved at step 2 and resumed ends where the unbroken one ends."""
    import random
    rnd = random.Random(7)
    words = ["red", "circle", "moves", "blue", "square", "up", "down", "left", "a", "the", "slowly", "fast"]
    (tmp_path / "d.jsonl").write_text("".join('{"text": "%s"}\n' % " ".join(rnd.choice(words) for _ in range(12))
                                              for _ in range(32)))
    (tmp_path / "a.lua").write_text(ADAPTED)
    # wide enough that the frozen base outweighs the adapters' alignment (4096 elements a chunk)
    common = [f"data={tmp_path / 'd.jsonl'}", f"kind={kind}", "hidden=256", "micro=4", "acc=1"]

    def launch(name, *more):
        p = run_wick("launch", "--nproc-per-node", 2, tmp_path / "a.lua", *common, *more,
                     f"result={tmp_path / (name + '.safetensors')}")
        return weights_and_peaks(p.stdout)
    plain = launch("plain")
    z3 = launch("z3", "shard=parameters")
    launch("z3_no_ck", "shard=parameters", "ck=false")
    whole = plain[0][0]
    # measured: lora 0.53, qlora 0.64 of the whole (the adapters' chunks are
    # padded to 4096 elements: 0.14 of this small QLoRA model); a rank that
    # kept the base whole would hold more than the whole
    for r in range(2):
        assert z3[r][0] <= 0.75 * whole, (r, z3[r][0], whole)
    assert z3[0][0] + z3[1][0] >= whole, (z3, whole)
    print(f"{kind}: weights per rank {max(v[0] for v in z3.values()) / 2**20:.2f} MiB against {whole / 2**20:.2f} MiB"
          f" unsharded; peak {max(v[1] for v in z3.values()) / 2**20:.2f} against {plain[0][1] / 2**20:.2f} MiB")
    assert_same_weights(tmp_path / "z3.safetensors", tmp_path / "plain.safetensors", rtol=1e-6)
    assert_same_weights(tmp_path / "z3_no_ck.safetensors", tmp_path / "plain.safetensors", rtol=1e-6)
    # a checkpoint of divided frozen weights, and a resume that reads it back into them
    launch("part", "shard=parameters", f"out={tmp_path / 'run'}", "save_every=2", "max_steps=2")
    launch("resumed", "shard=parameters", f"out={tmp_path / 'run'}", "save_every=2", "resume=true")
    assert_same_weights(tmp_path / "resumed.safetensors", tmp_path / "z3.safetensors", rtol=1e-6)


FRAMES = """
local wick = require "wick"
local a = wick.args
local data = wick.data("video_folder", { root = a.root, max_frames = 4, image_size = 32 })
wick.seed(3)
local model = wick.model("video_classifier", { classes = data.num_classes, image_size = 32, patch_size = 8,
  hidden_size = 32, intermediate_size = 64, layers = 2, heads = 2, temporal = "transformer", max_frames = 4,
  frame_chunk = 2 })
wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.1, momentum = 0.9 }),
  micro_batch = tonumber(a.micro), accumulate = tonumber(a.acc), epochs = 2, shuffle = false, quiet = true, seed = 1,
  checkpointing = true, shard = a.shard or "none", clip_grad_norm = 0 }
if wick.rank == 0 then model:save(a.result) end
"""


@pytest.mark.parametrize("shard", ["none", "gradients", "parameters"])
def test_a_block_run_several_times_per_forward_reduces_all_its_gradients(tmp_path, run_wick, shard):
    """Frames through the encoder two at a time, checkpointed: each chunk's
    run of an encoder block backpropagates on its own, so its parameters'
    gradients arrive once per chunk. The ranks' reduction waits for all of
    them (it used to leave with the first chunk's, and the ranks' weights
    drifted from one rank's without a word)."""
    clips = tmp_path / "clips"
    subprocess.run([WICK, "make-clips", str(clips), "--classes", "2", "--per-class", "4", "--size", "64x48",
                    "--seconds", "0.4", "--no-extras", "--no-images"], check=True, capture_output=True)
    (tmp_path / "f.lua").write_text(FRAMES)
    many, one = tmp_path / "many.safetensors", tmp_path / "one.safetensors"
    run_wick("launch", "--nproc-per-node", 2, tmp_path / "f.lua", f"root={clips / 'videos'}", "micro=1", "acc=2",
             f"shard={shard}", f"result={many}")
    run_wick("run", tmp_path / "f.lua", f"root={clips / 'videos'}", "micro=4", "acc=1", f"result={one}")
    wa, wb = load_file(str(many)), load_file(str(one))
    for k in wb:  # the attention keys' biases have no gradient: values of 1e-11, rounding alone
        d = (wa[k] - wb[k]).abs().max().item()
        assert d <= 1e-5 * wb[k].abs().max().item() + 1e-9, (k, d)  # the old reduction: 0.1 on cls_token


def layout(opts):
    """(wick's verb and its first arguments, the rest, the rank count) of ["--nproc-per-node", N, ...] or [...]"""
    n = int(opts[1]) if opts and opts[0] == "--nproc-per-node" else 1
    return (["launch", *opts[:2]] if n > 1 else ["run"]), list(opts[2 if n > 1 else 0:]), n


def test_the_end_of_run_summary_says_whose_memory_it_is(tmp_path, recipe, run_wick):
    p = run_wick("launch", "--nproc-per-node", 2, recipe, "micro=2", "acc=2", "epochs=1", "shard=gradients", "loud=true",
                 f"result={tmp_path / 'x.safetensors'}")
    line = next(l for l in (p.stdout + p.stderr).splitlines() if "held by tensors" in l)
    assert line.startswith("wick: memory of rank 0 of 2 (shard = gradients) on cpu: peak "), line


def test_the_run_gives_each_ranks_peak_at_its_start_and_end(tmp_path, recipe, run_wick):
    """Besides the steps' peak, the summary gives each rank's peak while the
    run starts (the model moved to the device and, under "parameters",
    divided) and while it ends (gathered back), and the whole run's. Under
    "parameters" the steps hold half the weights, but the start and the end
    still hold the whole model on every rank: the rest of "models bigger
    than one card"."""
    got = {}
    for shard in ["none", "parameters"]:
        p = run_wick("launch", "--nproc-per-node", 2, recipe, "micro=2", "acc=2", "epochs=1", "inputs=512",
                     "hidden=1024", "clip=0", f"shard={shard}", "loud=true",
                     f"result={tmp_path / (shard + '.safetensors')}")
        stdout = p.stdout.replace("[rank 1] ", "")
        peaks = {int(l.split()[1]): [int(x) for x in l.split()[2:]] for l in stdout.splitlines() if l.startswith("PEAKS ")}
        got[shard] = (peaks, weights_and_peaks(p.stdout))
        line = next(l for l in (p.stdout + p.stderr).splitlines() if "held by tensors" in l)
        assert "; the whole run's peak " in line and "(start " in line and ", end " in line, line
    whole = got["none"][1][0][0]
    for shard, (peaks, wp) in got.items():
        for r in range(2):
            start, end, run = peaks[r]
            assert run == max(start, end, wp[r][1]), (shard, r, peaks[r], wp[r])
            assert start >= whole and run >= whole, (shard, r, peaks[r], whole)
    for r in range(2):
        assert got["parameters"][1][r][0] < 0.6 * whole  # the steps: half the weights
        assert got["parameters"][0][r][1] >= whole  # the end: all of them, gathered back
    print({k: v[0] for k, v in got.items()}, whole)


@pytest.mark.parametrize("first,then", [
    (["--nproc-per-node", "2", "shard=gradients"], ["shard=none"]),            # to one rank, unsharded
    (["--nproc-per-node", "3", "shard=optimizer"], ["--nproc-per-node", "2", "shard=gradients"]),
    (["shard=none"], ["--nproc-per-node", "2", "shard=optimizer"]),            # a one-rank checkpoint, sharded
    (["--nproc-per-node", "2", "shard=parameters"], ["shard=none"]),          # ZeRO-3's whole checkpoint, one rank
    (["--nproc-per-node", "2", "shard=gradients"], ["--nproc-per-node", "3", "shard=parameters"]),
])
def test_a_sharded_checkpoint_resumes_with_another_rank_count_and_setting(tmp_path, recipe, run_wick, first, then):
    out = tmp_path / "run"

    def start(opts, *more):  # 12 samples per step in every layout: micro 2 x accumulate 6 / ranks
        verb, rest, n = layout(opts)
        return run_wick(*verb, recipe, "micro=2", f"acc={12 // (2 * n)}", "schedule=constant", *rest, *more)

    start(first, "max_steps=5", f"out={out}", f"result={tmp_path / 'first.safetensors'}")
    start(then, "resume=true", f"out={out}", f"result={tmp_path / 'resumed.safetensors'}")
    start([], f"result={tmp_path / 'unbroken.safetensors'}")
    assert_same_weights(tmp_path / "resumed.safetensors", tmp_path / "unbroken.safetensors")


@pytest.mark.parametrize("nproc,shard,shape", [
    (2, "gradients", []), (2, "optimizer", []),
    (2, "gradients", ["inputs=65", "hidden=127"]),  # odd element counts: 8-bit codes then fp32 scales in one message
])
def test_a_sharded_checkpoint_holds_one_ranks_state_and_is_cut_again_on_resume(tmp_path, recipe, run_wick, nproc,
                                                                               shard, shape):
    """adamw8bit (8-bit codes and per-block scales, fp32 moments below 4096
    elements, a step count): the joined state equals, entry for entry, what
    the same ranks unsharded keep; resumed sharded, it continues as the
    unsharded resume does. Two ranks and no clipping: the reduced gradients are
    the same bits either way (a + b), so the codes must be too."""
    common = ["--nproc-per-node", nproc, recipe, "micro=2", "acc=2", "optim=adamw8bit", "clip=0", "schedule=constant",
              *shape]
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    run_wick("launch", *common, f"shard={shard}", "max_steps=5", f"out={sharded}", f"result={tmp_path / 'a.safetensors'}")
    run_wick("launch", *common, "max_steps=5", f"out={plain}", f"result={tmp_path / 'b.safetensors'}")
    ck = "checkpoints/step-00000005"
    mine, theirs = load_file(str(sharded / ck / "optimizer.safetensors")), load_file(str(plain / ck / "optimizer.safetensors"))
    model = load_file(str(plain / ck / "model.safetensors"))
    assert set(mine) == set(theirs)
    for k in theirs:
        assert mine[k].shape == theirs[k].shape, k
        assert mine[k].dtype == theirs[k].dtype, k
        assert torch.equal(mine[k], theirs[k]), k
    cut = [n for n, w in model.items() if w.numel() > 4096]  # the weights whose state was cut and joined
    assert cut and all(mine[f"{n}.exp_avg.codes"].shape == model[n].shape for n in cut)
    # resume both, sharded and not, from the unsharded checkpoint
    shutil.copytree(plain, sharded, dirs_exist_ok=True)
    run_wick("launch", *common, f"shard={shard}", "resume=true", f"out={sharded}", f"result={tmp_path / 'c.safetensors'}")
    run_wick("launch", *common, "resume=true", f"out={plain}", f"result={tmp_path / 'd.safetensors'}")
    assert_same_weights(tmp_path / "c.safetensors", tmp_path / "d.safetensors", rtol=1e-7)


def test_a_sharded_run_resumed_as_it_was_equals_the_unbroken_run(tmp_path, recipe, run_wick):
    out = tmp_path / "run"
    common = ["--nproc-per-node", "2", recipe, "micro=3", "acc=2", "epochs=2", "shard=gradients", "schedule=constant"]
    run_wick("launch", *common, "max_steps=5", f"out={out}", f"result={tmp_path / 'a.safetensors'}")
    run_wick("launch", *common, "resume=true", f"out={out}", f"result={tmp_path / 'resumed.safetensors'}")
    run_wick("launch", *common, f"result={tmp_path / 'unbroken.safetensors'}")
    assert_same_weights(tmp_path / "resumed.safetensors", tmp_path / "unbroken.safetensors", rtol=1e-6)


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_fp16_loss_scaling_with_sharded_gradients_gives_the_unsharded_ranks_weights(tmp_path, recipe, run_wick, shard):
    """The pieces' gradients are unscaled and checked for inf/nan on each rank,
    the overflow agreed; the result is the unsharded ranks' up to the norm's
    summation order (clipping)."""
    many, plain = tmp_path / "many.safetensors", tmp_path / "plain.safetensors"
    # ZeRO-3 sums a window micro-batch by micro-batch, another order, which
    # fp16's roundings (and the clipping norm's, summed from pieces) enlarge
    # step after step: one micro-batch per rank and no clipping keep every sum
    # the same (a + b on 2 ranks), and the weights are the same bits
    # the clipping norm, summed from pieces in another order, is the rest: on an
    # AVX-512 CPU fp16 enlarged it to 1.7e-3 of the weights over the run, so
    # no clipping here either, and the same bits
    split = ["micro=4", "acc=1", "clip=0"] if shard == "parameters" else ["micro=2", "acc=2", "clip=0"]
    common = ["--nproc-per-node", 2, recipe, *split, "precision=fp16-mixed"]
    p = run_wick("launch", *common, f"shard={shard}", f"result={many}")
    q = run_wick("launch", *common, f"result={plain}")
    assert_same_weights(many, plain, rtol=1e-7)
    assert p.stdout.split("rank 0 steps ")[1].split()[0] == q.stdout.split("rank 0 steps ")[1].split()[0]


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_master_weights_sharded_give_the_unsharded_ranks_weights(tmp_path, recipe, run_wick, shard):
    """bf16-true with fp32 master weights: the fp32 gradients summed over the
    window are reduce-scattered, each rank steps its pieces of the masters,
    the masters are all-gathered and rounded into the bf16 weights (ZeRO-3:
    rounded into the rank's pieces of the bf16 weights, whose blocks gather
    them). Without clipping the same bits as the unsharded ranks (ZeRO-3 sums
    micro-batch by micro-batch: one per rank keeps the sums the same)."""
    many, plain = tmp_path / "many.safetensors", tmp_path / "plain.safetensors"
    split = ["micro=8", "acc=1"] if shard == "parameters" else ["micro=2", "acc=4"]
    common = ["--nproc-per-node", 2, recipe, *split, "precision=bf16-true", "masters=true", "clip=0"]
    run_wick("launch", *common, f"shard={shard}", f"result={many}")
    run_wick("launch", *common, f"result={plain}")
    assert_same_weights(many, plain, rtol=1e-7)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_master_weights_are_divided_and_checkpoint_as_one_ranks(tmp_path, recipe, run_wick, shard):
    """bf16-true with fp32 masters and an fp32 average (ema), sharded: each
    rank keeps only its pieces of the masters (the two ranks' bytes add up to
    the unsharded rank's, neither holds over half plus the alignment), the
    gathered updates round into the bf16 weights with the same bits, the
    checkpoint holds every master, moment and average entry equal to the
    unsharded ranks' checkpoint; resumed unsharded it ends where the unbroken
    run ends, and an unsharded checkpoint resumed on three sharded ranks
    ends where three unsharded ranks resumed from it end."""
    common = ["recipe", "micro=2", "precision=bf16-true", "masters=true", "clip=0", "schedule=constant", "ema=0.9",
              "epochs=1"]

    def run(ranks, *more):
        verb = ["launch", "--nproc-per-node", str(ranks)] if ranks > 1 else ["run"]
        args = [recipe if a == "recipe" else a for a in common]
        p = run_wick(*verb, *args, f"acc={12 // (2 * ranks)}", *more)
        return masters(p.stdout)

    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    held = run(2, f"shard={shard}", "max_steps=4", f"out={sharded}", f"result={tmp_path / 'a.safetensors'}")
    whole = run(2, "max_steps=4", f"out={plain}", f"result={tmp_path / 'b.safetensors'}")
    assert_masters_divided(held, whole)
    assert_same_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=1e-7)
    ck = "checkpoints/step-00000004/optimizer.safetensors"
    mine = assert_same_entries(sharded / ck, plain / ck)
    assert sum(k.startswith("wick.master/") for k in mine) == sum(k.startswith("wick.ema/") for k in mine) > 4
    # resumed unsharded from the joined masters: the unbroken run's bits (bf16
    # weights round differently on another rank count, so the layout is kept)
    shutil.copytree(sharded, tmp_path / "r2")
    run(2, "resume=true", f"out={tmp_path / 'r2'}", f"result={tmp_path / 'r2.safetensors'}")
    run(2, f"result={tmp_path / 'unbroken.safetensors'}")
    assert_same_weights(tmp_path / "r2.safetensors", tmp_path / "unbroken.safetensors", rtol=1e-7)
    # whole masters cut into three ranks' pieces: as three ranks unsharded resume
    shutil.copytree(plain, tmp_path / "r3s")
    shutil.copytree(plain, tmp_path / "r3n")
    run(3, f"shard={shard}", "resume=true", f"out={tmp_path / 'r3s'}", f"result={tmp_path / 'r3s.safetensors'}")
    run(3, "resume=true", f"out={tmp_path / 'r3n'}", f"result={tmp_path / 'r3n.safetensors'}")
    assert_same_weights(tmp_path / "r3s.safetensors", tmp_path / "r3n.safetensors", rtol=1e-7)


def test_parameters_divide_the_masters_and_checkpoint_as_one_ranks(tmp_path, recipe, run_wick):
    """bf16-true with fp32 masters and an fp32 average (ema) under shard =
    "parameters": the bf16 weights, the fp32 masters, the moments and the
    average are divided (the ranks' master and optimizer bytes add up to one
    unsharded rank's), each micro-batch's bf16 gradients are
    reduce-scattered in fp32, the weights are the unsharded ranks' bits; the
    evaluation with the average gives the unsharded ranks' loss; the
    checkpoint holds every master, moment and average equal to the unsharded
    ranks', as does ema.safetensors, and resumes unsharded to the unbroken
    run, and an unsharded checkpoint resumes on three such ranks as on three
    unsharded ones (the average too). One micro-batch per rank, no clipping:
    the same sums."""
    common = ["precision=bf16-true", "masters=true", "clip=0", "schedule=constant", "epochs=1", "acc=1", "ema=0.9"]
    evals = {}

    def run(ranks, *more):
        verb = ["launch", "--nproc-per-node", str(ranks)] if ranks > 1 else ["run"]
        p = run_wick(*verb, recipe, *common, f"micro={12 // ranks}", *more)
        evals[more] = evals_of(p.stdout)
        return masters(p.stdout)

    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    z3 = ("shard=parameters", "max_steps=4", f"out={sharded}", f"result={tmp_path / 'a.safetensors'}", "eval=2",
          "eval_ema=true")
    plain_args = ("max_steps=4", f"out={plain}", f"result={tmp_path / 'b.safetensors'}", "eval=2", "eval_ema=true")
    held = run(2, *z3)
    whole = run(2, *plain_args)
    assert_masters_divided(held, whole)
    assert_same_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=1e-7)
    assert len(evals[z3]) == 2 and float(evals[z3][0][1]) > 0, evals  # the average's loss, on each rank
    for (loss, ema_loss), (loss1, ema_loss1) in zip(evals[z3], evals[plain_args]):
        assert abs(float(loss) - float(loss1)) < 1e-6 and abs(float(ema_loss) - float(ema_loss1)) < 1e-6, evals
    assert evals[z3][0][0] != evals[z3][0][1]  # the average is not the weights
    ck = "checkpoints/step-00000004"
    for f in ("optimizer.safetensors", "model.safetensors", "../../ema.safetensors"):
        assert_same_entries(sharded / ck / f, plain / ck / f)
    kept = load_file(str(sharded / ck / "optimizer.safetensors"))
    assert sum(k.startswith("wick.master/") for k in kept) == sum(k.startswith("wick.ema/") for k in kept) > 4
    shutil.copytree(sharded, tmp_path / "r2")
    run(2, "resume=true", f"out={tmp_path / 'r2'}", f"result={tmp_path / 'r2.safetensors'}")
    run(2, f"result={tmp_path / 'unbroken.safetensors'}")
    assert_same_weights(tmp_path / "r2.safetensors", tmp_path / "unbroken.safetensors", rtol=1e-7)
    shutil.copytree(plain, tmp_path / "r3s")
    shutil.copytree(plain, tmp_path / "r3n")
    run(3, "shard=parameters", "resume=true", f"out={tmp_path / 'r3s'}", f"result={tmp_path / 'r3s.safetensors'}")
    run(3, "resume=true", f"out={tmp_path / 'r3n'}", f"result={tmp_path / 'r3n.safetensors'}")
    assert_same_weights(tmp_path / "r3s.safetensors", tmp_path / "r3n.safetensors", rtol=1e-7)
    assert_same_weights(tmp_path / "r3s" / "ema.safetensors", tmp_path / "r3n" / "ema.safetensors", rtol=1e-7)


@pytest.mark.parametrize("nproc,size", [(2, ["inputs=512", "hidden=1024"]), (3, ["inputs=8", "hidden=16"])])
def test_parameters_keep_the_average_divided_and_evaluate_it(tmp_path, recipe, run_wick, nproc, size):
    """ema under shard = "parameters" in fp32: each rank keeps the average of
    its pieces (optimizer bytes, the average included, half of the unsharded
    rank's), the evaluation with the average gives the unsharded ranks' loss
    (not the weights' loss), and ema.safetensors is theirs. A model whose
    every tensor is under one alignment unit leaves rank 2 of 3 no pieces at
    all: it still takes part in the average's evaluation and save."""
    common = ["--nproc-per-node", nproc, recipe, "clip=0", "schedule=constant", "epochs=1", "acc=1", "micro=6",
              "max_steps=4", "ema=0.9", "eval=2", "eval_ema=true", *size]
    got = {}
    for shard in ["none", "parameters"]:
        p = run_wick("launch", *common, f"shard={shard}", f"out={tmp_path / shard}",
                     f"result={tmp_path / (shard + '.safetensors')}")
        got[shard] = (evals_of(p.stdout), results(p.stdout))
    (evals, res), (evals1, res1) = got["parameters"], got["none"]
    for (loss, avg), (loss1, avg1) in zip(evals, evals1):
        assert abs(float(loss) - float(loss1)) < 1e-6 and abs(float(avg) - float(avg1)) < 1e-6, got
        assert abs(float(avg) - float(loss)) > 1e-3, got  # the average, not the weights
    if size[0] == "inputs=512":
        assert res[0][0] + res[1][0] <= res1[0][0] * 1.05 and max(res[0][0], res[1][0]) < res1[0][0] * 0.55, (res, res1)
    else:
        assert res[2][0] == 0, res  # rank 2 holds nothing
    assert_same_weights(tmp_path / "parameters" / "ema.safetensors", tmp_path / "none" / "ema.safetensors", rtol=1e-6)


DIE = """
local wick = require "wick"
local data = wick.data("synthetic", { size = 100000, inputs = 64, classes = 3 })
local model = wick.model("mlp", { inputs = 64, hidden = { 128 }, outputs = 3 })
local loader = wick.loader(data, { micro_batch = 4, accumulate = 2 })
local trainer = wick.trainer { model = model, optim = wick.optim("adamw", {}), shard = wick.args.shard }
for i = 1, 100000 do
  trainer:step(loader:next())
  if wick.rank == 1 and i == 5 then os.exit(3) end
end
"""


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_rank_that_dies_in_a_sharded_run_ends_every_rank_naming_it(tmp_path, shard):
    r = tmp_path / "die.lua"
    r.write_text(DIE)
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(r), f"shard={shard}"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "WICK_DIST_TIMEOUT": "3"})
    assert p.returncode == 1
    assert "rank 1 exited with code 3" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_a_rank_that_dies_under_wick_train_ends_every_rank_and_one_rank_resumes(tmp_path, recipe, shard):
    """Each shard setting under wick.train: rank 1 exits at step 5; rank 0,
    waiting in a collective (under "parameters" a gather of some block's
    weights), fails within the timeout and the launcher names rank 1; one
    rank resumes from the last checkpoint and ends where an unbroken run
    ends. Under "parameters" in a custom loop too."""
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(recipe), "micro=2", "acc=2", "epochs=50",
                        f"shard={shard}", "die_at=5", f"result={tmp_path / 'x.safetensors'}"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "WICK_DIST_TIMEOUT": "3"})
    assert p.returncode == 1
    assert "rank 1 exited with code 3" in p.stderr, p.stderr
    assert "Exception raised from" not in p.stderr
    assert time.monotonic() - t0 < 60
    # killed after a checkpoint at step 4: one rank resumes from it and ends
    # where an unbroken run of the same effective batch ends
    out = tmp_path / "run"
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(recipe), "micro=2", "acc=2", "epochs=1",
                        f"shard={shard}", "die_at=5", "save_every=2", "schedule=constant", f"out={out}",
                        f"result={tmp_path / 'x.safetensors'}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WICK_DIST_TIMEOUT": "3"})
    assert p.returncode == 1 and (out / "checkpoints" / "step-00000004").is_dir(), p.stderr
    subprocess.run([WICK, "run", str(recipe), "micro=4", "acc=2", "epochs=1", "schedule=constant", "resume=true",
                    f"out={out}", f"result={tmp_path / 'resumed.safetensors'}"], check=True, capture_output=True,
                   timeout=120)
    subprocess.run([WICK, "run", str(recipe), "micro=8", "acc=1", "epochs=1", "schedule=constant",
                    f"result={tmp_path / 'unbroken.safetensors'}"], check=True, capture_output=True, timeout=120)
    assert_same_weights(tmp_path / "resumed.safetensors", tmp_path / "unbroken.safetensors")
    if shard != "parameters":
        return  # their custom loops: test_a_rank_that_dies_in_a_sharded_run_ends_every_rank_naming_it
    r = tmp_path / "die.lua"
    r.write_text(DIE)
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(r), "shard=parameters"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "WICK_DIST_TIMEOUT": "3"})
    assert p.returncode == 1
    assert "rank 1 exited with code 3" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60


LOOP = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 96, inputs = 512, classes = 3, seed = 4 })
wick.seed(5)
local model = wick.model("mlp", { inputs = 512, hidden = { 1024, 96 }, outputs = 3 })
local loader = wick.loader(data, { micro_batch = 2, accumulate = 2, seed = 1 })
local trainer = wick.trainer { model = model, optim = wick.optim("adamw", { lr = 0.01 }), shard = a.shard,
  ema = 0.9, total_steps = 2 * loader:windows_per_epoch() }
if a.uneven then
  local ok, err = pcall(function() trainer:evaluate(wick.rank == 0 and data or wick.data("synthetic",
    { size = 48, inputs = 512, classes = 3, seed = 4 })) end)
  print("UNEVEN " .. tostring(ok) .. " " .. tostring(err))
  return
end
for epoch = 0, 1 do
  loader:start_epoch(epoch)
  for window in loader.next, loader do trainer:step(window) end
  print(string.format("EVAL %d %.9f", epoch, trainer:evaluate(data, 16).loss))
  if epoch == 0 then
    local ok, err = pcall(function() model:save(a.out .. "/early.safetensors") end)
    print("EARLY " .. tostring(ok) .. " " .. tostring(err))
  end
end
trainer:save(a.out .. "/checkpoints", { epoch = 2, window = 0 })
trainer:save_ema(a.out .. "/ema.safetensors")
if a.forget then
  trainer = nil
  collectgarbage()
  collectgarbage()
  local ok, err = pcall(function() model:save(a.out .. "/lost.safetensors") end)
  print("LOST " .. tostring(ok) .. " " .. tostring(err))
  return
end
trainer:finish()
-- the model runs as any model now: on one rank alone, its blocks keep their weights
if wick.rank == 0 then print(string.format("AFTERFINISH %.9f", wick.evaluate(model, data).loss)) end
if wick.rank == 0 then model:save(a.out .. "/final.safetensors") end
loader:start_epoch(2)
local ok, err = pcall(function() trainer:step(loader:next()) end)
print("AFTER " .. tostring(ok) .. " " .. tostring(err))
"""


def test_a_custom_loop_under_parameters_ends_where_the_unsharded_loop_ends(tmp_path, run_wick):
    """wick.trainer with shard = "parameters" on 2 ranks: its steps, its
    evaluations (trainer:evaluate gathers block by block), its checkpoint,
    its average and, after trainer:finish() on every rank, the model equal
    the same loop unsharded; reading the model before finish() is refused by
    name, as is a step after it, and a loop that lets its trainer go without
    finish() leaves a model that says its weights are lost."""
    r = tmp_path / "loop.lua"
    r.write_text(LOOP)
    out = {}
    for shard in ["none", "parameters"]:
        p = run_wick("launch", "--nproc-per-node", 2, r, f"shard={shard}", f"out={tmp_path / shard}")
        out[shard] = p.stdout.replace("[rank 1] ", "")
    evals = {k: [float(l.split()[2]) for l in v.splitlines() if l.startswith("EVAL ")] for k, v in out.items()}
    assert len(evals["parameters"]) == 4, out  # two epochs, two ranks
    for a, b in zip(evals["parameters"], evals["none"]):
        assert abs(a - b) < 1e-5 * abs(b), evals
    z3, plain = tmp_path / "parameters", tmp_path / "none"
    # the window's sums taken micro-batch by micro-batch (another order): AdamW carries the last bits
    # (9.3e-5 on an AVX-512 CPU, under 5e-5 on AVX2 ones)
    assert_same_weights(z3 / "final.safetensors", plain / "final.safetensors", rtol=2e-4)
    assert_same_weights(z3 / "ema.safetensors", plain / "ema.safetensors", rtol=2e-4)
    ck = "checkpoints/step-00000024/model.safetensors"
    assert_same_weights(z3 / ck, z3 / "final.safetensors", rtol=1e-30)
    assert "EARLY true" in out["none"]
    assert out["parameters"].count("EARLY false") == 2 and "trainer:finish()" in out["parameters"], out["parameters"]
    assert out["parameters"].count("AFTER false") == 2 and "the trainer was finished" in out["parameters"]
    p = run_wick("launch", "--nproc-per-node", 2, r, "shard=parameters", "forget=true", f"out={tmp_path / 'forget'}")
    assert p.stdout.count("LOST false") == 2 and "did not call trainer:finish()" in p.stdout, p.stdout
    after = [float(l.split()[1]) for l in out["parameters"].splitlines() if l.startswith("AFTERFINISH ")]
    assert len(after) == 1 and abs(after[0] - evals["parameters"][-1]) < 1e-5, (after, evals)
    # evaluating other data on each rank would unpair the gathers: refused naming both ranks
    p = run_wick("launch", "--nproc-per-node", 2, r, "shard=parameters", "uneven=true", f"out={tmp_path / 'uneven'}")
    assert p.stdout.count("UNEVEN false") == 2 and "rank 1 evaluates 48 samples and rank 0 96" in p.stdout, p.stdout


# A decoder whose activations (attention over 256 tokens) outweigh its
# weights many times: the step's peak follows the micro-batch, so a cap on
# one rank can fit 4 sequences and not 8.
OOM = """
local wick = require "wick"
local a = wick.args
local data = wick.data("text", { file = a.tokens, max_length = 256 })
wick.seed(0)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 64, intermediate_size = 176, layers = 3, heads = 4 })
if a.cap then wick.core.set_memory_limit(wick.rank == a.cap_rank and a.cap or 0) end
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-3 }), micro_batch = a.micro,
  accumulate = a.acc, batch_size = a.batch, max_steps = 4, shuffle = false, shard = "parameters", checkpointing = a.ck or false,
  quiet = true, on_oom = a.on_oom }
if wick.rank == 0 then model:save(a.result) end
print(string.format("PEAK %d %d split %d", wick.rank, run.memory.peak, run.steps))
"""


def peaks(stdout):
    return {int(l.split()[1]): int(l.split()[2]) for l in stdout.replace("[rank 1] ", "").replace("[rank 2] ", "")
            .splitlines() if l.startswith("PEAK ")}


@pytest.mark.parametrize("nproc,who,ck", [
    (2, 1, "false"),  # runs out in a forward (the attention's scores)
    (3, 0, "true"),   # in a backward's recomputation, on rank 0 of 3
])
def test_parameters_recover_from_running_out_of_memory_on_one_rank(tmp_path, run_wick, nproc, who, ck):
    """shard = "parameters": one rank runs out of memory partway through a
    micro-batch, with gathers and reduce-scatters behind it and more ahead
    on the others. It finishes that micro-batch's collectives as its last
    whole one issued them (with nothing in them), the ranks agree after the
    window, and every rank redoes it in halves: the same bits as a run given
    the halved micro-batch from the start, and one rank's result."""
    r = tmp_path / "oom.lua"
    r.write_text(OOM)
    g = torch.Generator().manual_seed(1)
    (tmp_path / "tokens.jsonl").write_text("".join(
        '{"input_ids":[%s]}\n' % ",".join(map(str, torch.randint(0, 256, (256,), generator=g).tolist()))
        for _ in range(64 * nproc)))
    common = ["--nproc-per-node", nproc, r, f"tokens={tmp_path / 'tokens.jsonl'}", f"ck={ck}"]
    whole = run_wick("launch", *common, "micro=8", "acc=2", f"result={tmp_path / 'whole.safetensors'}")
    halved = run_wick("launch", *common, "micro=4", "acc=4", f"result={tmp_path / 'halved.safetensors'}")
    p8, p4 = peaks(whole.stdout)[who], peaks(halved.stdout)[who]
    assert p4 < p8 * 0.75, (p4, p8)  # the micro-batch decides the peak
    cap = (p4 + p8) // 2
    p = run_wick("launch", *common, "micro=8", "acc=2", f"cap={cap}", f"cap_rank={who}",
                 f"result={tmp_path / 'capped.safetensors'}")
    assert "out of memory in step 1: micro_batch 8 -> 4, accumulate 2 -> 4" in p.stderr, p.stderr
    assert_same_weights(tmp_path / "capped.safetensors", tmp_path / "halved.safetensors", rtol=1e-30)
    # another split sums in another order: AdamW's normalized steps carry the last bits a little further.
    # Measured (OMP_NUM_THREADS=1, Sapphire Rapids): 1.86e-4 and 1.66e-4 ([2-1-false], [3-0-true]) at
    # the default avx512, 1.59e-4 and 1.36e-4 with ATEN_CPU_CAPABILITY=avx2, 5e-5 and 4e-5 with the
    # recipe's seed shifted; the bound was 2e-4 (7% above the worst). The recovery's bits are checked
    # against the halved run above (rtol 1e-30); this says only that the split changes nothing but rounding
    assert_same_weights(tmp_path / "capped.safetensors", tmp_path / "whole.safetensors", rtol=5e-4)
    # micro_batch = "auto" probes nothing here: it starts from the rank's
    # whole share of the batch and halves it where memory runs out
    a = run_wick("launch", *common, "micro=auto", f"batch={16 * nproc}", f"cap={cap}", f"cap_rank={who}",
                 f"result={tmp_path / 'auto.safetensors'}")
    assert "micro_batch 16 -> 4, accumulate 1 -> 4" in a.stderr, a.stderr  # halved twice
    assert_same_weights(tmp_path / "auto.safetensors", tmp_path / "halved.safetensors", rtol=1e-30)
    # recovery off, or a cap that not even one sequence fits (the one-sample
    # micro-batch run first, at loss x 0, to learn the collectives, says so):
    # every rank ends, the one that ran out saying why, none waiting on it
    for extra, said in [(["on_oom=fail", f"cap={cap}"], 'recovery is off: on_oom = "fail"'),
                        ([f"cap={p4 // 4}"], "in the one-sample micro-batch that shard = \"parameters\" runs first")]:
        t0 = time.monotonic()
        q = subprocess.run([WICK, "launch", *map(str, common), "micro=8", "acc=2", f"cap_rank={who}", *extra,
                            f"result={tmp_path / 'x.safetensors'}"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "WICK_DIST_TIMEOUT": "20"})
        assert q.returncode != 0 and said in q.stderr, q.stderr
        assert "Exception raised from" not in q.stderr
        assert time.monotonic() - t0 < 60


SAVE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 32, inputs = 512, classes = 3, seed = 4 })
local model = wick.model("mlp", { inputs = 512, hidden = { 512, 512, 512 }, outputs = 3 })
local loader = wick.loader(data, { micro_batch = 4, accumulate = 1, seed = 1 })
local trainer = wick.trainer { model = model, optim = wick.optim("sgd", { lr = 0.01 }), shard = "parameters" }
loader:start_epoch(0)
trainer:step(loader:next())
collectgarbage()
local before = wick.core.memory(false).cpu_tensors
wick.core.reset_peak()
trainer:save(a.out .. "/checkpoints", { epoch = 0, window = 1 })
print(string.format("SAVE %d %d", wick.rank, wick.core.memory(false).cpu_tensors_peak - before))
trainer:finish()
if wick.rank == 0 then model:save(a.out .. "/final.safetensors") end
-- a new trainer (weights divided again) whose weights are perturbed, then loaded
local again = wick.trainer { model = model, optim = wick.optim("sgd", { lr = 0.01 }), shard = "parameters" }
again:step(loader:next())
collectgarbage()
before = wick.core.memory(false).cpu_tensors
wick.core.reset_peak()
again:load(a.out .. "/checkpoints/step-00000001")
print(string.format("LOAD %d %d", wick.rank, wick.core.memory(false).cpu_tensors_peak - before))
again:finish()
if wick.rank == 0 then model:save(a.out .. "/loaded.safetensors") end
"""


def test_a_checkpoint_under_parameters_gathers_one_block_at_a_time(tmp_path, run_wick):
    """Saving under shard = "parameters" gathers one unit at a time, rank 0
    writing each unit's tensors into the file as it comes: every rank holds
    one block's weights more at most, never the whole model (rank 0 kept a
    host copy of every unit until the file was written, before); the
    checkpoint holds the weights the model has after trainer:finish().
    Loading reads the file one unit at a time on every rank, keeping its
    chunk: no rank holds more than a block more, and the loaded weights are
    the checkpoint's."""
    (tmp_path / "save.lua").write_text(SAVE)
    p = run_wick("launch", "--nproc-per-node", 2, tmp_path / "save.lua", f"out={tmp_path}")
    grew = {int(l.split()[1]): int(l.split()[2]) for l in p.stdout.replace("[rank 1] ", "").splitlines()
            if l.startswith("SAVE ")}
    block, whole = (512 * 512 + 512) * 4, (512 * 512 * 3 + 512 * 3 + 512 * 3 + 3) * 4
    # one block's weights (c10d's gloo all-gather added a temporary of the
    # same size, which wick's makes no more, as NCCL's): before, the whole model
    for r in range(2):  # rank 0 too: it writes each unit as it comes (it held the whole model before)
        assert grew[r] <= block * 1.05 and grew[r] < whole, (grew, block, whole)
    assert_same_weights(tmp_path / "checkpoints" / "step-00000001" / "model.safetensors",
                        tmp_path / "final.safetensors", rtol=1e-30)
    loaded = {int(l.split()[1]): int(l.split()[2]) for l in p.stdout.replace("[rank 1] ", "").splitlines()
              if l.startswith("LOAD ")}
    assert len(loaded) == 2 and max(loaded.values()) <= block * 1.05, (loaded, block)  # before: the whole model
    assert_same_weights(tmp_path / "loaded.safetensors", tmp_path / "final.safetensors", rtol=1e-30)


@pytest.mark.parametrize("args,expect", [
    (["shard=zero3"], "command line: shard=zero3: expected string (none | optimizer | gradients | parameters)"),
    (["shard=gradients", "sync=micro_batch"], "sync = \"micro_batch\" cannot be used with it"),
    (["shard=parameters", "sync=micro_batch"], "sync = \"micro_batch\" cannot be used with it"),
])
def test_shard_settings_that_cannot_work_are_refused_by_name(tmp_path, recipe, run_wick, args, expect):
    p = run_wick("launch", "--nproc-per-node", 2, recipe, "micro=2", "acc=2", *args,
                 f"result={tmp_path / 'x.safetensors'}", check=False)
    assert p.returncode != 0
    assert expect in p.stderr, p.stderr
    assert "Exception raised from" not in p.stderr  # no C++ frames


TEST_PLUGINS = os.environ.get("WICK_TEST_PLUGIN_DIR", os.path.join(os.path.dirname(WICK), "..", "lib", "wick",
                                                                    "test-plugins"))


@pytest.mark.parametrize("optim,who", [("unit_step", "the optimizer"),
                                       ("unit_group", "the optimizer of parameter group groups[1]")])
def test_an_optimizer_without_elementwise_updates_is_not_sharded(tmp_path, recipe, optim, who):
    """An optimizer plugin that does not derive from wick::ElementwiseUpdates
    (here each tensor's step is divided by its gradient's norm, which over a
    piece would be the piece's) is refused by name under shard, on every
    rank, before a step; with shard = "none" the same ranks train with it."""
    env = dict(os.environ, WICK_PLUGIN_PATH=os.path.join(TEST_PLUGINS, "optim"))
    args = [WICK, "launch", "--nproc-per-node", "2", recipe, "micro=2", "acc=2", f"optim={optim}", "epochs=1",
            f"result={tmp_path / 'w.safetensors'}"]
    p = subprocess.run(args + ["shard=optimizer"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0
    assert f'shard = "optimizer": {who} does not declare elementwise updates' in p.stderr, p.stderr
    assert "Exception raised from" not in p.stderr and not (tmp_path / "w.safetensors").exists()
    p = subprocess.run(args + ["shard=none"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.safetensors").exists()


def test_plan_on_ranks_gives_each_shard_settings_per_rank_figures(tmp_path, recipe, run_wick):
    """wick plan --ranks 2 measures one step per setting on two launched ranks
    (rank 0 prints, once): the shard rows hold per rank a part of the
    unsharded state (weights + gradients + optimizer: the optimizer state and
    the reduced gradients halve, and with parameters the weights too), and a cap only a sharded setting fits is met
    by suggesting it. Bad --ranks values are usage errors, and --ranks inside
    a launcher is refused."""
    args = ["plan", recipe, "--ranks", "2", "micro=4", "acc=2", "inputs=512", "hidden=1024", "clip=0", "epochs=1",
            f"result={tmp_path / 'x.safetensors'}"]
    out = run_wick(*args).stdout
    assert out.count("wick plan:") == 1 and "[rank 1]" not in out, out
    assert 'measured on 2 ranks, shard = "none"' in out, out

    def row(name):
        line = next(l for l in out.splitlines() if l.strip().startswith(name))
        mib = [float(x) for x in re.findall(r"([\d.]+) MiB", line)]
        return mib[0], mib[-2]  # peak, state (then the start and end's peak)
    peak, state = row("as given")
    # the trainer's start and end hold the whole model under every setting (the rest of issue 38)
    assert "the run's start and end as given" in out and "start/end" in out, out
    _, opt_state = row('shard = "optimizer"')
    g_peak, g_state = row('shard = "gradients"')
    # mlp 512 -> 1024 -> 96 -> 3 in fp32 with AdamW: weights W, gradients W, moments 2W unsharded
    assert 0.55 * state < opt_state < 0.70 * state, (state, opt_state)  # W + W/2 + W rather than 4W
    assert g_state == opt_state
    _, p_state = row('shard = "parameters"')
    assert 0.45 * state < p_state < 0.55 * state, (state, p_state)  # (W + W + 2W) / 2: the weights divided too
    assert not (tmp_path / "x.safetensors").exists()
    # a cap between the gradients row's peak and the unsharded one's: a sharded setting is suggested
    assert g_peak < peak * 0.97, out
    cap = int((g_peak + peak) / 2 * 2 ** 20 / 0.9)
    out = run_wick(*args[:2], "--device-memory", f"{cap}B", *args[2:]).stdout
    fits = next(l for l in out.splitlines() if l.strip().startswith("fastest that fits"))
    assert re.search(r'shard = "(optimizer|gradients|parameters)" \(peak', fits), out
    for bad, says in (("0", "--ranks expects a whole number from 1 to 64, not '0'"),
                      ("two", "--ranks expects a whole number from 1 to 64, not 'two'")):
        p = run_wick("plan", recipe, "--ranks", bad, check=False)
        assert p.returncode == 2 and says in p.stderr, p.stderr
    p = subprocess.run([WICK, "plan", recipe, "--ranks", "2"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, WORLD_SIZE="2"))
    assert p.returncode == 2 and "already one of WORLD_SIZE=2 ranks" in p.stderr, p.stderr


DEFERRED = """
local wick = require "wick"
local a = wick.args
local data = wick.data("text", { file = a.data, max_length = 24, cache_dir = "none" })
wick.seed(3 + (a.seed_apart and wick.rank or 0))
local hidden = tonumber(a.hidden or 128)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = hidden, intermediate_size = 2 * hidden,
  layers = tonumber(a.layers or 3), heads = 4, deferred = a.deferred == true, quantize = a.quantize or "none",
  path = a.path, dtype = a.dtype })
if a.kind then wick.optim(a.kind, a.kind == "qlora" and { r = 4, compute_dtype = "fp32" } or { r = 4 }):apply(model) end
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4,
  accumulate = 1, max_steps = 2, shuffle = false, quiet = true, seed = 1, shard = a.shard or "parameters",
  checkpointing = true, precision = a.precision or "fp32", master_weights = a.masters == true, out = a.out,
  return_weights = a.rw }
if wick.rank == 0 then model:save(a.result) end
print(string.format("PEAKS %d %d %d", wick.rank, run.memory.start_peak, run.memory.weights))
"""

# a Hugging Face folder for the cases that read one: bf16, as transformers saves it
FOLDER = """
local wick = require "wick"
wick.seed(11)
wick.save_pretrained(wick.model("decoder_lm", { vocab_size = 257, hidden_size = 128, intermediate_size = 256,
  layers = 6, heads = 4, dtype = "bf16" }), wick.args.out)
"""


def sentences(path, n=32, seed=7):
    import random
    rnd = random.Random(seed)
    words = ["red", "circle", "moves", "blue", "square", "up", "down", "left", "a", "the", "slowly", "fast"]
    path.write_text("".join('{"text": "%s"}\n' % " ".join(rnd.choice(words) for _ in range(12)) for _ in range(n)))


@pytest.mark.parametrize("case", ["full", "bf16-masters", "lora", "qlora", "qlora-after", "folder", "folder-fp32",
                                  "folder-qlora", "folder-fp32-qlora-after"])
def test_a_deferred_model_is_made_divided_with_the_bits_of_a_whole_build(tmp_path, run_wick, case):
    """decoder_lm with deferred = true under shard = "parameters" on 2 ranks:
    no weight exists until the trainer divides the model; each rank then
    makes every value one tensor at a time (the random draws replayed from
    the states the build recorded, or the folder's tensors read) and keeps
    its chunks. The trained model has the bits of the run from a whole
    build, for full training (fp32; bf16-true with fp32 masters), LoRA,
    QLoRA over the model's own NF4 layers or over its float layers (each
    quantized as its values are made, as the whole build's qlora quantizes
    the whole weight), and a folder (plain, read into fp32 from its bf16,
    and quantized on load or by qlora after); and the rank's start holds
    about half the weights where the whole build holds all of them."""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "a.lua").write_text(DEFERRED)
    more = {"full": [], "bf16-masters": ["precision=bf16-true", "masters=true"], "lora": ["kind=lora"],
            "qlora": ["kind=qlora", "quantize=nf4"], "qlora-after": ["kind=qlora"], "folder": [],
            "folder-fp32": ["dtype=fp32"], "folder-qlora": ["kind=qlora", "quantize=nf4"],
            "folder-fp32-qlora-after": ["dtype=fp32", "kind=qlora"]}[case]
    if case.startswith("folder"):
        (tmp_path / "f.lua").write_text(FOLDER)
        run_wick("run", tmp_path / "f.lua", f"out={tmp_path / 'hf'}")
        more.append(f"path={tmp_path / 'hf'}")

    def launch(deferred):
        p = run_wick("launch", "--nproc-per-node", 2, tmp_path / "a.lua", f"data={tmp_path / 'd.jsonl'}", "layers=6", *more,
                     f"deferred={str(deferred).lower()}", f"result={tmp_path / f'{deferred}.safetensors'}")
        out = p.stdout.replace("[rank 1] ", "")
        return {int(l.split()[1]): [int(x) for x in l.split()[2:]] for l in out.splitlines() if l.startswith("PEAKS ")}
    whole, deferred = launch(False), launch(True)
    assert_same_entries(tmp_path / "True.safetensors", tmp_path / "False.safetensors")
    if "qlora" not in case:  # (a small NF4 model's per-tensor quantizing temporaries outweigh its half)
        for r in range(2):
            weights = whole[r][1]  # this rank's chunks: half the model's weights
            assert whole[r][0] >= 1.8 * weights, (case, r, whole[r])  # the whole build's start: all of them
            assert deferred[r][0] <= 1.5 * weights, (case, r, deferred[r], weights)  # half, a unit, a tensor
    print(case, whole, deferred)


def test_plan_measures_a_deferred_model_as_its_run_holds_it(tmp_path, run_wick):
    """wick plan --ranks 2 of a recipe that builds deferred and ends in a file:
    every row starts from the deferred model (each rank making its chunks)
    and a shard = "parameters" row ends as the run's file end does (each unit
    gathered in turn), so the start/end column is that run's, not a whole
    build's; rows of other shards make the model whole, as their runs would.
    Nothing is written."""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "a.lua").write_text(DEFERRED)
    common = [tmp_path / "a.lua", "--ranks", "2", f"data={tmp_path / 'd.jsonl'}", "layers=6",
              f"result={tmp_path / 'x.safetensors'}"]

    def edges(out):
        rows = {}
        for line in out.splitlines():
            m = re.match(r"  (\S.*?)\s{2,}[\d.]+ [KM]iB .* ([\d.]+) MiB\s*$", line)
            if m:
                rows[m.group(1)] = float(m.group(2))
        return rows
    whole = run_wick("plan", *common, "deferred=false").stdout
    plan = run_wick("plan", *common, "deferred=true", "rw=file", f"out={tmp_path / 'run'}").stdout
    assert "failed:" not in plan, plan
    assert ("the run's start and end as given (the model built deferred, each rank making its chunks, written to a "
            "file a unit at a time)") in plan, plan
    w, d = edges(whole), edges(plan)
    assert set(d) == set(w) and len(d) >= 7, (w, d)
    # measured: 9.8 MiB where the whole build gathered back holds 13.0 (allocation sizes, deterministic)
    assert d["as given"] <= 0.85 * w["as given"], (d, w)
    for name in ("precision = \"bf16-mixed\"", "all of these"):  # later rows start deferred too
        assert d[name] <= 1.1 * d["as given"], (name, d)
    assert not (tmp_path / "run" / "model.safetensors").exists() and not (tmp_path / "x.safetensors").exists()


DEFERRED_VLM = """
local wick = require "wick"
local a = wick.args
local data = wick.data("video_folder", { manifest = a.manifest, max_frames = 2, image_size = 32, resize = "exact",
  tokenizer = "bytes", prompt = "<image>", text_length = 16 })
wick.seed(0)
local opts = a.path and { path = a.path } or { image_size = 32, patch_size = 8, vision_hidden_size = 64,
  vision_intermediate_size = 128, vision_layers = 2, vision_heads = 4, hidden_size = 128, intermediate_size = 256,
  layers = 2, heads = 4, projector = "mlp2x_gelu", vision_style = "clip", vocab_size = data.vocab_size }
opts.image_token_id = data.image_token_id
opts.freeze_vision = false
opts.deferred = a.deferred == true
opts.quantize = a.quantize or "none"
if a.qv then opts.freeze_vision, opts.quantize_vision = true, true end
local m = wick.model("vlm", opts)
local built = wick.memory(false).cpu_tensors
if a.save then wick.save_pretrained(m, a.save) return end
if a.kind then wick.optim(a.kind, { r = 4 }):apply(m) end
wick.train { model = m, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 2,
  max_steps = 2, checkpointing = true, shuffle = false, quiet = true, seed = 1, shard = "parameters" }
if wick.rank == 0 then m:save(a.result) end
print(string.format("BUILT %d %d", wick.rank, built))
"""


@pytest.mark.parametrize("case", ["options", "options-quantize-vision", "folder-qlora"])
def test_a_deferred_vlm_defers_its_language_model_and_tower_with_the_bits_of_a_whole_build(tmp_path, run_wick, case):
    """vlm with deferred = true: its language model (LLaVA's bulk) and its
    vision tower are built hollow, the projector whole; under shard =
    "parameters" on 2 ranks each rank makes its chunks of them, drawn as a
    whole build draws them (options) or read from a LLaVA folder, the
    language model's layers quantized to NF4 as each tensor comes (under
    QLoRA), or the frozen tower's layers quantized as they are made
    (quantize_vision). The trained model has the bits of a whole build's
    run, and the deferred build holds none of the language model's or the
    tower's bytes (but norms)."""
    clips = tmp_path / "clips"
    subprocess.run([WICK, "make-clips", str(clips), "--classes", "2", "--per-class", "4", "--size", "64x48",
                    "--seconds", "0.6", "--no-extras", "--no-images"], check=True, capture_output=True)
    (tmp_path / "v.lua").write_text(DEFERRED_VLM)
    common = [tmp_path / "v.lua", f"manifest={clips / 'manifest.csv'}"]
    more = []
    if case == "folder-qlora":
        run_wick("run", *common, f"save={tmp_path / 'hf'}")
        more = [f"path={tmp_path / 'hf'}", "quantize=nf4", "kind=qlora"]
    if case == "options-quantize-vision":
        more = ["quantize=nf4", "qv=true", "kind=qlora"]

    def launch(deferred):
        p = run_wick("launch", "--nproc-per-node", 2, *common, *more, f"deferred={str(deferred).lower()}",
                     f"result={tmp_path / f'{deferred}.safetensors'}")
        out = p.stdout.replace("[rank 1] ", "")
        return {int(l.split()[1]): int(l.split()[2]) for l in out.splitlines() if l.startswith("BUILT ")}
    whole, deferred = launch(False), launch(True)
    trained = assert_same_entries(tmp_path / "True.safetensors", tmp_path / "False.safetensors")
    language = sum(t.numel() * t.element_size() for k, t in trained.items()
                   if k.startswith(("model.language_model.", "lm_head.")) and "lora_" not in k)
    tower = sum(t.numel() * t.element_size() for k, t in trained.items()
                if k.startswith("model.vision_tower.") and "lora_" not in k and "norm" not in k)
    # what a deferred build holds of them: their norms, and for each random
    # step the generator's state (5 KB; about 20 steps here) to replay it from
    for r in range(2):
        extra = deferred[r] - (whole[r] - language - tower)
        assert extra <= 160 << 10, (case, r, whole[r], deferred[r], language, tower)
    print(case, whole, deferred, language)


QLORA_AFTER_FILE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("text", { file = a.data, max_length = 24, cache_dir = "none" })
wick.seed(3)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 128, intermediate_size = 256, layers = 2,
  heads = 4, deferred = a.deferred == true })
local function train(out, rw)
  wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4, max_steps = 2,
    shuffle = false, quiet = true, seed = 1, shard = "parameters", out = out, return_weights = rw }
end
train(a.dir .. "/1", a.rw)
wick.optim("qlora", { r = 4, compute_dtype = "fp32" }):apply(model)
train(a.dir .. "/2", a.rw)
if wick.rank == 0 then model:save(a.result) end
"""


@pytest.mark.parametrize("deferred", [False, True])
def test_qlora_over_a_model_left_in_a_file_quantizes_each_layer_as_it_is_read(tmp_path, run_wick, deferred):
    """A divided run that ends in a file (return_weights = "file") leaves the
    model hollow; qlora applied then makes each layer hollow 4-bit, and the
    next run (and model:save) quantize each layer's float weight as it is
    read from the file. The trained adapters and 4-bit base have the bits of
    the same recipe whose runs gather the weights back."""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "q.lua").write_text(QLORA_AFTER_FILE)
    common = ["launch", "--nproc-per-node", 2, tmp_path / "q.lua", f"data={tmp_path / 'd.jsonl'}",
              f"deferred={str(deferred).lower()}"]
    run_wick(*common, "rw=gathered", f"dir={tmp_path / 'g'}", f"result={tmp_path / 'gathered.safetensors'}")
    run_wick(*common, "rw=file", f"dir={tmp_path / 'f'}", f"result={tmp_path / 'file.safetensors'}")
    trained = assert_same_entries(tmp_path / "file.safetensors", tmp_path / "gathered.safetensors")
    assert any(k.endswith("nf4.packed") for k in trained) and any("lora_A" in k for k in trained), sorted(trained)


def test_a_deferred_model_is_made_whole_where_it_is_not_divided(tmp_path, run_wick):
    """One rank, or shard other than "parameters": the deferred model is made
    whole when wick.train gets it (saying so), with the bits of a whole
    build; a model method before training makes it whole too."""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "a.lua").write_text(DEFERRED)
    common = [tmp_path / "a.lua", f"data={tmp_path / 'd.jsonl'}", "shard=none"]
    run_wick("run", *common, "deferred=false", f"result={tmp_path / 'whole.safetensors'}")
    p = run_wick("run", *common, "deferred=true", f"result={tmp_path / 'one.safetensors'}")
    assert "wick: wick.train: the model was built deferred; its weights are made whole now" in p.stderr, p.stderr
    assert_same_entries(tmp_path / "one.safetensors", tmp_path / "whole.safetensors")
    run_wick("launch", "--nproc-per-node", 2, *common, "deferred=false", f"result={tmp_path / 'w2.safetensors'}")
    run_wick("launch", "--nproc-per-node", 2, *common, "deferred=true", "shard=gradients",
             f"result={tmp_path / 'z2.safetensors'}")
    run_wick("launch", "--nproc-per-node", 2, *common, "deferred=false", "shard=gradients",
             f"result={tmp_path / 'z2w.safetensors'}")
    assert_same_entries(tmp_path / "z2.safetensors", tmp_path / "z2w.safetensors")
    # model:save and wick.save_pretrained stream a deferred model a value at a
    # time (it stays deferred), NF4 layers dequantized and LoRA adapters
    # merged as they come; a method that needs the weights whole (model:load)
    # makes it whole first, saying so
    (tmp_path / "s.lua").write_text('local wick = require "wick"\nwick.seed(3)\nlocal a = wick.args\n'
                                    'local m = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 32, '
                                    'intermediate_size = 64, layers = 2, heads = 4, deferred = a.deferred, '
                                    'quantize = a.quantize, path = a.path })\n'
                                    'if a.lora then wick.optim("lora", { r = 4 }):apply(m) end\n'
                                    'print(m:blocks()[1], m:parameters())\nm:save(a.result)\n'
                                    'print("SAVED")\nwick.save_pretrained(m, a.hf, { merge = a.lora and true or nil })\n'
                                    'print("PRETRAINED")\nm:load(a.result)\n')
    # a folder whose norms are not ones (a deferred build holds ones until the folder's values are made)
    (tmp_path / "f.lua").write_text(FOLDER)
    run_wick("run", tmp_path / "f.lua", f"out={tmp_path / 'hf'}")
    folder = load_file(str(tmp_path / "hf" / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for k, v in folder.items():
        if k.endswith("norm.weight"):
            folder[k] = (1 + 0.5 * torch.rand(v.shape, generator=gen)).to(v.dtype)
    from safetensors.torch import save_file
    save_file(folder, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    for name, more in [("plain", []), ("qlora", ["quantize=nf4", "lora=true"]), ("folder", [f"path={tmp_path / 'hf'}"]),
                       ("folder-qlora", [f"path={tmp_path / 'hf'}", "quantize=nf4", "lora=true"])]:
        run_wick("run", tmp_path / "s.lua", "deferred=false", f"result={tmp_path / f'{name}0.safetensors'}",
                 f"hf={tmp_path / f'{name}_hf0'}", *more)
        p = run_wick("run", tmp_path / "s.lua", "deferred=true", f"result={tmp_path / f'{name}1.safetensors'}",
                     f"hf={tmp_path / f'{name}_hf1'}", *more)
        assert "model.layers.0\t" in p.stdout and "PRETRAINED" in p.stdout, p.stdout
        # only model:load made it whole
        assert p.stderr.count("its weights are made whole now") == 1, p.stderr
        assert "wick: model:load: the model was built deferred; its weights are made whole now" in p.stderr
        assert_same_entries(tmp_path / f"{name}1.safetensors", tmp_path / f"{name}0.safetensors")
        assert_same_entries(tmp_path / f"{name}_hf1" / "model.safetensors", tmp_path / f"{name}_hf0" / "model.safetensors")


def test_ranks_seeded_apart_cannot_make_one_deferred_model(tmp_path, run_wick):
    """Each rank makes the deferred model's values from its own random state:
    ranks seeded apart would divide two different models. Refused on every
    rank, naming it, before a step."""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "a.lua").write_text(DEFERRED)
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(tmp_path / "a.lua"), f"data={tmp_path / 'd.jsonl'}",
                        "deferred=true", "seed_apart=true", f"result={tmp_path / 'x.safetensors'}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert re.search(r"rank 1's deferred model \(made from the random state before wick\.model, or from a folder: seed "
                     r"every rank alike\) differs from rank 0's", p.stderr), p.stderr
    assert not (tmp_path / "x.safetensors").exists()


CAPPED = """
local wick = require "wick"
local a = wick.args
local data = wick.data("text", { file = a.data, max_length = 24, cache_dir = "none" })
wick.seed(3)
local model = wick.model("decoder_lm", { path = a.path, deferred = a.deferred == true, quantize = a.quantize or "none" })
wick.optim(a.kind or "lora", { r = 4 }):apply(model)
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4,
  accumulate = 1, shuffle = false, quiet = true, seed = 1, shard = a.shard or "parameters",
  checkpointing = true, out = a.out, save_every = a.out and 2 or 0, resume = a.resume == true,
  return_weights = a.out and "file" or "gathered", max_steps = tonumber(a.max_steps or 4) }
if wick.rank == 0 then model:save(a.result) end
local held = wick.memory(false).cpu_tensors
if a.hf then wick.save_pretrained(model, a.hf, { merge = true }) end
print(string.format("PEAKS %d %d %d %d %d", wick.rank, run.memory.start_peak, run.memory.end_peak,
  run.memory.run_peak, held))
"""


def peaks_of(stdout):
    out = re.sub(r"^\[rank \d+\] ", "", stdout, flags=re.M)
    return {int(l.split()[1]): [int(x) for x in l.split()[2:]] for l in out.splitlines() if l.startswith("PEAKS ")}


@pytest.mark.parametrize("nproc,kind", [(2, "lora"), (2, "qlora"), (3, "lora")])
def test_no_rank_ever_holds_the_whole_model(tmp_path, run_wick, nproc, kind):
    """A LoRA decoder (a 126 MB bf16 base, 24 blocks), or QLoRA over the same
    folder quantized as it loads (a 33 MB NF4 base), on 2 ranks (LoRA on 3 too), each capped
    by WICK_CPU_MEMORY_LIMIT at 0.85x the whole model's bytes: built deferred
    from a folder (a 4-bit layer quantized by each rank only where it keeps
    its codes), trained under shard = "parameters" with checkpoints
    streamed to rank 0's file a unit at a time, returned in
    out/model.safetensors (return_weights = "file"), saved by model:save a
    tensor at a time and by wick.save_pretrained with the adapters merged a
    layer at a time, stopped at step 2 and resumed, all under the cap. The
    trained weights equal an uncapped run's from a whole build, gathered back
    as usual; the whole build under the same cap is refused at once.
    (Measured whole runs: a rank peaks at 0.64x with LoRA on 2 ranks, 0.48x
    on 3, 0.72x with QLoRA, where its gradients' whole-length buffers no
    longer outlive their reduce-scatters; before that, QLoRA's peaked at
    0.93x.)"""
    sentences(tmp_path / "d.jsonl")
    (tmp_path / "f.lua").write_text(FOLDER.replace("hidden_size = 128, intermediate_size = 256", "hidden_size = 512, "
                                                   "intermediate_size = 1024").replace("layers = 6", "layers = 24"))
    run_wick("run", tmp_path / "f.lua", f"out={tmp_path / 'hf'}")
    (tmp_path / "c.lua").write_text(CAPPED)
    common = [tmp_path / "c.lua", f"data={tmp_path / 'd.jsonl'}", f"path={tmp_path / 'hf'}", f"kind={kind}",
              f"quantize={'nf4' if kind == 'qlora' else 'none'}"]
    plain = run_wick("launch", "--nproc-per-node", nproc, *common, f"result={tmp_path / 'plain.safetensors'}",
                     f"hf={tmp_path / 'plain_hf'}")
    whole = peaks_of(plain.stdout)[0][3]  # the model as built, whole, with its adapters
    cap = str(int(0.85 * whole))  # measured: a rank's whole run peaks at 0.64x / 0.48x (LoRA) and 0.72x (QLoRA)
    env = {**os.environ, "WICK_CPU_MEMORY_LIMIT": cap}
    refused = subprocess.run([WICK, "launch", "--nproc-per-node", str(nproc), *map(str, common),
                              f"result={tmp_path / 'no.safetensors'}"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "WICK_CPU_MEMORY_LIMIT" in refused.stderr, refused.stderr[-2000:]

    def capped(*more):
        p = subprocess.run([WICK, "launch", "--nproc-per-node", str(nproc), *map(str, common), "deferred=true",
                            *more], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        got = peaks_of(p.stdout)
        assert sorted(got) == list(range(nproc)), p.stdout
        return got
    run_dir = tmp_path / "run"
    got = capped(f"out={run_dir}", f"result={tmp_path / 'capped.safetensors'}", f"hf={tmp_path / 'capped_hf'}")
    for r in range(nproc):
        assert got[r][2] <= int(cap), (r, got[r], cap)  # the whole run's peak
        # after the run: the model deferred to the file (its adapters and the run's leftovers: 8.3 MB of
        # 126 (LoRA, 0.07x) and of 47 (QLoRA, 0.18x); a rank keeping its chunks would hold 0.5x, a gathered
        # model 1x)
        assert got[r][3] <= (0.1 if kind == "lora" else 0.3) * whole, (r, got[r])
    print(nproc, kind, "run peaks / whole:", [round(got[r][2] / whole, 3) for r in range(nproc)])
    assert_same_entries(tmp_path / "capped.safetensors", tmp_path / "plain.safetensors")
    assert_same_entries(run_dir / "model.safetensors", tmp_path / "plain.safetensors")
    assert_same_entries(tmp_path / "capped_hf" / "model.safetensors", tmp_path / "plain_hf" / "model.safetensors")
    # stopped at step 2 (its checkpoint streamed), resumed under the cap: the unbroken run's end
    part = tmp_path / "part"
    capped(f"out={part}", "max_steps=2", f"result={tmp_path / 'two.safetensors'}")
    capped(f"out={part}", "resume=true", f"result={tmp_path / 'resumed.safetensors'}")
    assert_same_entries(tmp_path / "resumed.safetensors", tmp_path / "plain.safetensors")
