"""decoder_lm against Hugging Face transformers on tiny random LLaMA and Qwen2
configs saved by transformers: logits, loss and gradients in fp32, and wick's
saved weights loading back into transformers."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("decoder_lm", { path = a.path })
wick.core.predict(model, a.batch, a.logits)
wick.core.gradients(model, a.batch, a.grads)
model:save(a.saved)
"""


def tiny(family, tie):
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                  tie_word_embeddings=tie)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        return transformers.Qwen2ForCausalLM(cfg)
    cfg = transformers.LlamaConfig(**common, attention_bias=False)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", False)])
def test_decoder_matches_transformers(tmp_path, run_wick, family, tie):
    torch.manual_seed(0)
    ref = tiny(family, tie).float().eval()
    with torch.no_grad():  # a random init with some spread in every norm and bias
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 97, (3, 11))
    labels = ids.clone()
    labels[1, 7:] = -100  # a shorter sequence: padding ignored in the loss
    labels[2, :3] = -100  # a masked prompt
    save_file({"input_ids": ids, "labels": labels}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}", f"grads={tmp_path / 'grads.safetensors'}",
             f"saved={tmp_path / 'wick.safetensors'}")

    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert (logits - out.logits.detach()).abs().max().item() < 1e-4
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5
    assert g["items"].item() == int((labels[:, 1:] != -100).sum())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)

    # wick's weights load back into transformers (strict) and give the same logits
    back = tiny(family, tie).float().eval()
    state = load_file(tmp_path / "wick.safetensors")
    missing, unexpected = back.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (tie or not missing)
    back.tie_weights()
    with torch.no_grad():
        assert (back(input_ids=ids).logits - out.logits).abs().max().item() < 1e-5


def test_sharded_checkpoint_loads(tmp_path, run_wick):
    torch.manual_seed(1)
    ref = tiny("llama", False).float().eval()
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 97, (2, 9))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("decoder_lm", { path = wick.args.path })\n'
        "wick.core.predict(m, wick.args.batch, wick.args.logits)\n")
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}")
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    assert (load_file(tmp_path / "logits.safetensors")["output"] - want).abs().max().item() < 1e-4


def test_accumulation_over_sequences_of_different_lengths_normalises_by_tokens(tmp_path, run_wick):
    """(micro 1, accumulate 4) equals (micro 4, accumulate 1) when the sequences hold different numbers of tokens.
    SGD with momentum: Adam's first steps move each weight by about lr whatever the gradient's size, so a
    component whose gradient is zero up to rounding would compare noise."""
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (8, 12))
    labels = ids.clone()
    for i, n in enumerate([12, 3, 7, 12, 5, 9, 2, 11]):
        labels[i, n:] = -100
    save_file({"input_ids": ids, "labels": labels}, tmp_path / "data.safetensors")
    recipe = """
local wick = require "wick"
local a = wick.args
wick.seed(3)
local m = wick.model("decoder_lm", { vocab_size = 50, hidden_size = 32, intermediate_size = 64, layers = 2, heads = 4, kv_heads = 2 })
wick.train { model = m, data = wick.data("tensors", { file = a.data }), optim = wick.optim("sgd", { lr = 0.5, momentum = 0.9 }),
  micro_batch = a.micro, accumulate = a.acc, epochs = 3, shuffle = false, quiet = true }
m:save(a.result)
"""
    (tmp_path / "r.lua").write_text(recipe)
    for micro, acc in [(1, 4), (4, 1)]:
        run_wick("run", tmp_path / "r.lua", f"data={tmp_path / 'data.safetensors'}", f"micro={micro}", f"acc={acc}",
                 f"result={tmp_path / f'{micro}x{acc}.safetensors'}")
    a, b = load_file(tmp_path / "1x4.safetensors"), load_file(tmp_path / "4x1.safetensors")
    # per-sequence means instead of per-token would differ by far more than this; reassociation's
    # rounding scales with each tensor's size (measured: 2.6e-6 of its largest entry after 6 steps)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5 * b[k].abs().max().item(), msg=k)


GEN = """
local wick = require "wick"
local m = wick.model("decoder_lm", { path = wick.args.path })
local ids = m:generate({ 5, 17, 42, 8 }, { max_new_tokens = 12 })
print(table.concat(ids, " "))
local sampled = m:generate({ 5, 17, 42, 8 }, { max_new_tokens = 12, temperature = 0.8, top_k = 10, top_p = 0.9, seed = 7 })
local again = m:generate({ 5, 17, 42, 8 }, { max_new_tokens = 12, temperature = 0.8, top_k = 10, top_p = 0.9, seed = 7 })
print(table.concat(sampled, " "))
print(table.concat(again, " "))
"""


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", False)])
def test_greedy_generation_with_the_kv_cache_matches_transformers(tmp_path, run_wick, family, tie):
    torch.manual_seed(4)
    ref = tiny(family, tie).float().eval()
    with torch.no_grad():  # sharper logits, so greedy choices are not near-ties
        for n, p in ref.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "g.lua").write_text(GEN)
    out = run_wick("run", tmp_path / "g.lua", f"path={tmp_path / 'hf'}").stdout.split("\n")
    got = [int(x) for x in out[0].split()]
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        # and without any cache: the full sequence again at every step
        seq = prompt
        for _ in range(12):
            seq = torch.cat([seq, ref(input_ids=seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert got == want == seq[0, 4:].tolist()
    sampled, again = out[1].split(), out[2].split()
    assert len(sampled) == 12 and sampled == again  # same seed, same sample


def test_a_folder_saved_by_wick_loads_in_transformers(tmp_path, run_wick):
    (tmp_path / "s.lua").write_text(
        'local wick = require "wick"\n'
        'wick.seed(11)\n'
        'local m = wick.model("decoder_lm", { family = "qwen2", vocab_size = 61, hidden_size = 32, intermediate_size = 48,'
        ' layers = 2, heads = 4, kv_heads = 2, tie_embeddings = true })\n'
        "wick.save_pretrained(m, wick.args.dir)\n"
        "wick.core.predict(m, wick.args.batch, wick.args.logits)\n")
    ids = torch.randint(0, 61, (2, 7))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    run_wick("run", tmp_path / "s.lua", f"dir={tmp_path / 'saved'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").float().eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    assert (load_file(tmp_path / "logits.safetensors")["output"] - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("same", [False, True])
def test_a_tied_config_with_its_own_lm_head_weight_does_what_transformers_does(tmp_path, run_wick, same):
    """tie_word_embeddings true, and the file holds an lm_head.weight: transformers
    leaves the head untied and uses the file's when it differs from the token
    embedding (saying so), and ties it when it is the same. wick generates the
    same tokens and says so too."""
    torch.manual_seed(5)
    ref = tiny("llama", True).float().eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in weights
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed.clone() if same else torch.randn_like(embed) * 4
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(loaded.lm_head.weight, weights["lm_head.weight"])
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        want = loaded.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        untied_tokens = ref.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert same or want != untied_tokens  # the case tells the two readings apart
    (tmp_path / "g.lua").write_text(GEN)
    p = run_wick("run", tmp_path / "g.lua", f"path={tmp_path / 'hf'}")
    assert [int(x) for x in p.stdout.split("\n")[0].split()] == want
    assert ("stays a separate output head, as transformers leaves it" in p.stderr) == (not same)


ROPE_RECIPE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("decoder_lm", { path = a.path })
wick.core.predict(model, a.batch, a.logits)
wick.save_pretrained(model, a.out)
"""

# head_dim 16 and rope_theta 5000: llama3's three bands (kept, smoothed, divided) all hold frequencies
ROPE_CASES = [
    ("linear", {"rope_type": "linear", "factor": 2.0}),
    ("legacy linear", {"type": "linear", "factor": 3.0}),
    ("dynamic", {"rope_type": "dynamic", "factor": 3.0}),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("yarn mscale", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
                     "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
]


@pytest.mark.parametrize("name,rope", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_scaling_matches_transformers(tmp_path, run_wick, name, rope):
    """rope_scaling (legacy) and rope_parameters of each type wick computes: logits
    equal transformers' over 150 positions (past max_position_embeddings, 128,
    so dynamic scaling acts), and the folder wick saves loads into transformers
    with the same scaling."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=dict(rope))
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    # the config.json as users' folders carry it: rope_scaling with type (legacy) or rope_parameters
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    c.pop("rope_scaling", None)
    c.pop("rope_parameters", None)
    c["rope_theta"] = 5000.0
    if "type" in rope:
        c["rope_scaling"] = dict(rope)
    else:
        c["rope_parameters"] = {"rope_theta": 5000.0, **rope}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    ids = torch.randint(0, 97, (2, 150))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(ROPE_RECIPE)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}", f"out={tmp_path / 'saved'}")
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
            **cfg.to_dict(), "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}))
        plain.load_state_dict(ref.state_dict())
        unscaled = plain.float().eval()(input_ids=ids).logits
    got = load_file(tmp_path / "logits.safetensors")["output"]
    assert (want - unscaled).abs().max().item() > 1e-3  # the scaling changes the logits
    assert (got - want).abs().max().item() < 1e-4
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").float().eval()
    assert back.config.rope_parameters["rope_type"] == rope.get("rope_type", rope.get("type"))
    with torch.no_grad():
        assert (back(input_ids=ids).logits - want).abs().max().item() < 1e-4
