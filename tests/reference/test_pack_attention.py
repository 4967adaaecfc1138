"""data 'text' with pack = true, pack_attention = "document" against each
document run unpacked: documents packed into one row, with position_ids
restarting at each and attention within each document only, give each
token the logits (so the per-token losses) it has when its document is a
row of its own, in fp32; the loss of the packed batch is the mean of those
per-token losses over the same targets (a document's first token is no
target), and its gradients are those of the pieces as rows of their own. The default, pack_attention = "row" (documents see those before
them), gives other logits, so the comparison can fail. LLaMA, and Gemma 2
(soft-capped scores through their own path, a sliding window shorter than
the rows) as transformers saves them."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

V = 257  # the bytes tokenizer: 256 bytes and the end of text

DATA = """
local wick = require "wick"
local a = wick.args
for _, mode in ipairs({ "document", "row", "none" }) do
  local o = { files = { a.docs }, max_length = 40, cache_dir = "none" }
  if mode ~= "none" then o.pack = true; o.pack_attention = mode end
  local d = wick.data("text", o)
  local idx = {}
  for i = 0, d:size() - 1 do idx[#idx + 1] = i end
  wick.core.save_samples(d, idx, a.out .. "/" .. mode .. ".safetensors")
end
"""

PREDICT = """
local wick = require "wick"
local a = wick.args
local model = wick.model("decoder_lm", { path = a.path })
for _, name in ipairs({ "document", "row", "none" }) do
  wick.core.predict(model, a.out .. "/batch_" .. name .. ".safetensors", a.out .. "/logits_" .. name .. ".safetensors")
end
wick.core.gradients(model, a.out .. "/batch_document.safetensors", a.out .. "/grads_document.safetensors")
wick.core.gradients(model, a.out .. "/batch_pieces.safetensors", a.out .. "/grads_pieces.safetensors")
"""


def tiny(family):
    common = dict(vocab_size=V, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    common["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**{**common, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 7,
                                           "attn_logit_softcapping": 1.0, "final_logit_softcapping": 1.5,
                                           "tie_word_embeddings": True})
        return transformers.Gemma2ForCausalLM(cfg)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def rows(samples, n):
    """The samples' tensors, padded (position_ids continuing, as the data set's collate pads them), and their lengths."""
    lengths = [samples[f"{i}.input_ids"].numel() for i in range(n)]
    T = max(lengths)
    out = {"input_ids": torch.full((n, T), 256), "labels": torch.full((n, T), -100)}
    if "0.position_ids" in samples:
        out["position_ids"] = torch.zeros((n, T), dtype=torch.long)
    for i, k in enumerate(lengths):
        out["input_ids"][i, :k] = samples[f"{i}.input_ids"]
        out["labels"][i, :k] = samples[f"{i}.labels"]
        if "position_ids" in out:
            p = samples[f"{i}.position_ids"]
            out["position_ids"][i, :k] = p
            out["position_ids"][i, k:] = torch.arange(p[-1] + 1, p[-1] + 1 + T - k)
    return out, lengths


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_documents_packed_apart_equal_each_document_unpacked(tmp_path, run_wick, family):
    torch.manual_seed(0)
    ref = tiny(family).float().eval()
    with torch.no_grad():  # spread in the norms; larger weights, so Gemma 2's softcaps act
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif family == "gemma2":
                p.mul_(4.0)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    # 12 documents of 3 to 22 bytes: several to a 40-token row, some cut by a row's end
    g = torch.Generator().manual_seed(1)
    (tmp_path / "docs").mkdir()
    for i in range(12):
        n = int(torch.randint(3, 23, (1,), generator=g))
        text = "".join(chr(c) for c in torch.randint(97, 123, (n,), generator=g).tolist())
        (tmp_path / "docs" / f"d{i:02d}.txt").write_text(text)
    (tmp_path / "data.lua").write_text(DATA)
    run_wick("run", tmp_path / "data.lua", f"docs={tmp_path / 'docs' / '*.txt'}", f"out={tmp_path}")
    packed, lengths = {}, {}
    for name in ["document", "row", "none"]:
        s = load_file(tmp_path / f"{name}.safetensors")
        n = len([k for k in s if k.endswith(".input_ids")])
        packed[name], lengths[name] = rows(s, n)
        save_file(packed[name], tmp_path / f"batch_{name}.safetensors")
    assert "position_ids" in packed["document"] and "position_ids" not in packed["row"]
    # each packed piece (a document, or its part in a row) as a row of its own, with the same targets
    doc = packed["document"]
    pieces = []
    for r, real in enumerate(lengths["document"]):
        starts = [t for t in range(real) if doc["position_ids"][r, t] == 0] + [real]
        pieces += [(doc["input_ids"][r, a:b], doc["labels"][r, a:b]) for a, b in zip(starts, starts[1:])]
    T = max(len(i) for i, _ in pieces)
    alone_batch = {"input_ids": torch.full((len(pieces), T), 256), "labels": torch.full((len(pieces), T), -100)}
    for k, (i, lab) in enumerate(pieces):
        alone_batch["input_ids"][k, :len(i)] = i
        alone_batch["labels"][k, :len(i)] = lab
    save_file(alone_batch, tmp_path / "batch_pieces.safetensors")
    (tmp_path / "predict.lua").write_text(PREDICT)
    run_wick("run", tmp_path / "predict.lua", f"path={tmp_path / 'hf'}", f"out={tmp_path}")
    logits = {k: load_file(tmp_path / f"logits_{k}.safetensors")["output"] for k in packed}

    # each unpacked document, by its tokens
    alone = {}
    for i, k in enumerate(lengths["none"]):
        alone[tuple(packed["none"]["input_ids"][i, :k].tolist())] = logits["none"][i, :k]
    assert len(alone) == 12
    # each document's piece in a packed row: a whole document, its beginning
    # (cut by the row's end) or its end (a row's first piece, which begins anew)
    worst, worst_row, pieces, whole, later = 0.0, 0.0, 0, 0, 0
    for r, real in enumerate(lengths["document"]):
        pos = doc["position_ids"][r, :real]
        starts = [t for t in range(real) if pos[t] == 0] + [real]
        for a, b in zip(starts, starts[1:]):
            piece = tuple(doc["input_ids"][r, a:b].tolist())
            match = next((v for key, v in alone.items() if key[:len(piece)] == piece), None)
            if match is None:  # a row's first piece, the end of a document: run alone it is its own document
                assert a == 0
                continue
            pieces += 1
            whole += len(piece) == match.shape[0]
            worst = max(worst, (logits["document"][r, a:b] - match[:b - a]).abs().max().item())
            if a > 0:  # after another document in the row: "row" lets it see that one
                later += 1
                worst_row = max(worst_row, (logits["row"][r, a:b] - match[:b - a]).abs().max().item())
    assert pieces >= 8 and whole >= 6 and later >= 4, (pieces, whole, later)
    # fp32: the same sums in another order (measured 1.0e-7 on AVX-512, 8.9e-8 with AVX2; Gemma 2 0)
    assert worst < 1e-4, worst
    assert worst_row > 0.05, worst_row  # the default differs by far more (measured 0.53, Gemma 2 2.1)

    # the packed batch's loss: the unpacked per-token losses of its targets, a document's first token none
    grads = load_file(tmp_path / "grads_document.safetensors")
    lab = doc["labels"][:, 1:]
    ce = F.cross_entropy(logits["document"][:, :-1].reshape(-1, V), lab.reshape(-1), ignore_index=-100, reduction="sum")
    assert grads["items"].item() == int((lab != -100).sum())
    assert abs(grads["loss"].item() - ce.item() / grads["items"].item()) < 1e-5
    starts = doc["position_ids"] == 0
    assert (doc["labels"][:, 1:][starts[:, 1:]] == -100).all()  # no document's first token is a target
    # and training sees what it sees with each piece a row of its own: the same loss, items and gradients
    apart = load_file(tmp_path / "grads_pieces.safetensors")
    assert apart["items"].item() == grads["items"].item()
    assert abs(apart["loss"].item() - grads["loss"].item()) < 1e-5
    for k in grads:  # the worst difference is 0.0067 of this bound (AVX-512; AVX2 0.0052), the loss's 0
        if k.startswith("grad."):
            torch.testing.assert_close(grads[k], apart[k], rtol=1e-4, atol=1e-6, msg=k)

    # transformers reads packed position_ids the same way (its own mask from them, without a cache)
    with torch.no_grad():
        want = ref(input_ids=doc["input_ids"], position_ids=doc["position_ids"], use_cache=False).logits
    real = torch.arange(doc["input_ids"].shape[1])[None, :] < torch.tensor(lengths["document"])[:, None]
    assert (logits["document"] - want)[real].abs().max().item() < 1e-4
