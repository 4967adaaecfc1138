"""QLoRA: wick's 4-bit NF4 weights with double quantization, byte for byte
against the scheme written out here from the paper (Dettmers et al. 2023)
and bitsandbytes' dynamic map, and against bitsandbytes' own quantize_4bit
where it runs on the CPU (scripts/setup installs it): the same 4-bit codes,
scales and offset, the 8-bit constants equal or one step apart where its CPU
kernel rounds a near-midpoint value the other way; the storage it reports, a
quantized forward equal to the dequantized model's, and QLoRA training that
lowers the loss."""
import re

import torch
from safetensors.torch import load_file

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])

QUANTIZE = """
local wick = require "wick"
local a = wick.args
wick.seed(3)
local model = wick.model("decoder_lm", { vocab_size = 64, hidden_size = 128, intermediate_size = 256, layers = 2, heads = 4 })
local data = wick.data("text", { file = a.data, max_length = 32 })
model:save(a.before)
local q = wick.optim("qlora", { r = 4, compute_dtype = "fp32" })
q:apply(model)
local quantized = wick.evaluate(model, data, { micro_batch = 4 }).loss
print(string.format("bytes_per_param %.6f base_bytes %d before %d layers %d", q.bytes_per_param, q.base_bytes,
  q.base_bytes_before, q.layers))
model:save(a.quantized)
q:merge(model)  -- B is still zero: the merged weights are the dequantized ones
model:save(a.merged)
print(string.format("loss quantized %.7f merged %.7f", quantized, wick.evaluate(model, data, { micro_batch = 4 }).loss))
"""

TRAIN = """
local wick = require "wick"
local a = wick.args
wick.seed(a.init or 1)
local model = wick.model("decoder_lm", { vocab_size = 64, hidden_size = 128, intermediate_size = 256, layers = 2, heads = 4 })
local data = wick.data("text", { file = a.data, max_length = 32 })
local q = wick.optim("qlora", { r = 8, alpha = 16, compute_dtype = a.compute })
q:apply(model)
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-2, weight_decay = 0 }),
  micro_batch = 4, accumulate = 2, epochs = a.epochs or 20, quiet = true, seed = a.seed or 2 }
print(string.format("first %.5f last %.5f", run.history[1].loss, run.final_loss))
"""


def token_file(path, n=24, length=32):
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(n):
        start = int(torch.randint(0, 8, (1,), generator=g))
        ids = [(start + 3 * i) % 60 for i in range(length)]  # a learnable pattern
        lines.append('{"input_ids": [%s]}' % ",".join(map(str, ids)))
    path.write_text("\n".join(lines) + "\n")
    return path


def dynamic_map():
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), written out."""
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    return torch.tensor(sorted(data + [0.0, 1.0]))


def reference(w, block=64, scale_block=256):
    """Quantize and dequantize w as the paper and bitsandbytes describe, independently of wick:
    the packed codes, the 8-bit constants, their per-256 scales and offset, and the weight back."""
    blocks = w.float().reshape(-1, block)
    absmax = blocks.abs().amax(1)
    idx = (blocks / absmax[:, None]).unsqueeze(-1).sub(NF4).abs().argmin(-1)
    packed = (idx[:, 0::2] * 16 + idx[:, 1::2]).reshape(-1).to(torch.uint8)
    offset = absmax.mean()
    c = absmax - offset
    pad = (-len(c)) % scale_block
    groups = torch.cat([c, torch.zeros(pad)]).reshape(-1, scale_block)
    scale = groups.abs().amax(1)
    code = dynamic_map()
    q = (groups / scale[:, None]).unsqueeze(-1).sub(code).abs().argmin(-1).reshape(-1)[: len(c)]
    absmax_deq = code[q] * scale.repeat_interleave(scale_block)[: len(c)] + offset
    return {"packed": packed, "absmax_q": q.to(torch.uint8), "absmax_scale": scale, "absmax_offset": offset,
            "weight": (NF4[idx] * absmax_deq[:, None]).reshape(w.shape)}


def bitsandbytes_reference(w):
    """The same from bitsandbytes itself, where it runs on this machine's CPU (None elsewhere)."""
    try:
        import bitsandbytes.functional as F
        q, st = F.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True)
        deq = F.dequantize_4bit(q, st)
    except Exception:  # not installed, or no CPU backend in this version
        return None
    return {"packed": q.reshape(-1), "absmax_q": st.absmax.reshape(-1), "absmax_scale": st.state2.absmax,
            "absmax_offset": st.offset, "weight": deq.reshape(w.shape)}


def test_nf4_with_double_quantization_matches_the_paper(tmp_path, run_wick):
    (tmp_path / "q.lua").write_text(QUANTIZE)
    paths = {k: tmp_path / f"{k}.safetensors" for k in ("before", "quantized", "merged")}
    p = run_wick("run", tmp_path / "q.lua", f"data={token_file(tmp_path / 'd.jsonl')}",
                 *[f"{k}={v}" for k, v in paths.items()])
    before, quantized, merged = (load_file(paths[k]) for k in ("before", "quantized", "merged"))
    names = [k[: -len(".nf4.packed")] for k in quantized if k.endswith(".nf4.packed")]
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down in each layer; not the head
    assert "lm_head.weight" in quantized and not any(k.startswith("lm_head.nf4") for k in quantized)
    total_params = total_err = 0
    checked_against_bitsandbytes = []
    mismatched_constants = [0, 0]
    for n in names:
        w = before[n + ".weight"]
        assert n + ".weight" not in quantized, "the float weight is gone"
        ref = reference(w)
        assert torch.equal(quantized[n + ".nf4.packed"], ref["packed"]), n
        assert torch.equal(quantized[n + ".nf4.absmax_q"], ref["absmax_q"]), n
        torch.testing.assert_close(quantized[n + ".nf4.absmax_scale"], ref["absmax_scale"], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(quantized[n + ".nf4.absmax_offset"], ref["absmax_offset"].reshape(()),
                                   rtol=1e-7, atol=0, msg=n)
        torch.testing.assert_close(merged[n + ".weight"], ref["weight"], rtol=0, atol=1e-6, msg=n)
        deq = ref["weight"]
        bnb = bitsandbytes_reference(w)
        if bnb is not None:
            checked_against_bitsandbytes.append(n)
            # the same 4-bit codes, the same scales and offset, byte for byte
            assert torch.equal(quantized[n + ".nf4.packed"], bnb["packed"]), n
            torch.testing.assert_close(quantized[n + ".nf4.absmax_scale"], bnb["absmax_scale"], rtol=0, atol=0, msg=n)
            torch.testing.assert_close(quantized[n + ".nf4.absmax_offset"], bnb["absmax_offset"].reshape(()),
                                       rtol=1e-7, atol=0, msg=n)
            # bitsandbytes' CPU kernel does not always pick the nearest entry of
            # the dynamic map: near midpoints it may take the neighbour
            step = (quantized[n + ".nf4.absmax_q"].int() - bnb["absmax_q"].int()).abs()
            assert step.max() <= 1 and (step > 0).float().mean() < 0.02, (n, int((step > 0).sum()))
            same = (step == 0).repeat_interleave(64).reshape(w.shape)
            torch.testing.assert_close(merged[n + ".weight"][same], bnb["weight"][same], rtol=0, atol=1e-6, msg=n)
            mismatched_constants[0] += int((step > 0).sum())
            mismatched_constants[1] += step.numel()
        total_params += w.numel()
        total_err += ((deq - w) ** 2).sum().item() / (w ** 2).mean().item()
    print(f"{len(checked_against_bitsandbytes)} of {len(names)} layers also checked against bitsandbytes; "
          f"{mismatched_constants[0]} of {mismatched_constants[1]} 8-bit constants one step apart")
    # 4 bits per weight: about a tenth of the weights' scale as error, not more
    assert (total_err / total_params) ** 0.5 < 0.15
    m = re.search(r"bytes_per_param ([\d.]+) base_bytes (\d+) before (\d+) layers (\d+)", p.stdout)
    bpp, base, before_bytes, layers = float(m[1]), int(m[2]), int(m[3]), int(m[4])
    assert layers == 14
    assert abs(bpp * 8 - 4.127) < 0.01, bpp  # 4 + 8/64 + 32/(64*256) bits
    assert before_bytes == 4 * total_params and base < before_bytes / 7.5
    # the 4-bit forward (fp32 compute) is the dequantized model's forward
    q_loss, m_loss = map(float, re.search(r"loss quantized ([\d.]+) merged ([\d.]+)", p.stdout).groups())
    assert abs(q_loss - m_loss) < 1e-5 * m_loss


# Measured (OMP_NUM_THREADS=1, Intel Sapphire Rapids, ATEN_CPU_CAPABILITY
# avx2 and the default avx512): last / first over init and data-order seeds
# (1, 2) + 100 k, k = 0..7, bf16 and fp32 compute alike. At 6 epochs (18 steps)
# it was 0.54-0.67 and 3 of 6 seeds failed the bound 0.6; at 20 epochs it is
# 0.440-0.480 in all 32 runs, and a model that does not learn stays at ~1.0
# (the first loss is ln 64 = 4.16 on this pattern).
def test_qlora_training_lowers_the_loss(tmp_path, run_wick):
    (tmp_path / "t.lua").write_text(TRAIN)
    data = token_file(tmp_path / "d.jsonl")
    for compute in ("bf16", "fp32"):
        p = run_wick("run", tmp_path / "t.lua", f"data={data}", f"compute={compute}")
        first, last = map(float, re.search(r"first ([\d.]+) last ([\d.]+)", p.stdout).groups())
        assert last < 0.6 * first, (compute, first, last)
