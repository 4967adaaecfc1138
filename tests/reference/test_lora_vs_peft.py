"""LoRA against PEFT: the same base weights and adapter give the same logits
and adapter gradients; an adapter saved by PEFT loads in wick and one saved
by wick loads in PEFT; merging keeps the outputs."""
import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny(family="llama"):
    kw = dict(vocab_size=73, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
    if family == "qwen2":  # q, k and v carry biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).float().eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float().eval()


RECIPE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("decoder_lm", { path = a.base })
local lora = wick.optim("lora", {})
lora:load(model, a.adapter)               -- r, alpha and targets from adapter_config.json
assert(lora.layers == a.layers, lora.layers)
wick.core.predict(model, a.batch, a.logits)
wick.core.gradients(model, a.batch, a.grads)
local total, trainable = model:parameters()
print(total, trainable)
-- one training step on the batch, then the adapter goes back to PEFT
wick.train { model = model, data = wick.data("tensors", { file = a.batch }), optim = wick.optim("sgd", { lr = 0.5 }),
  micro_batch = 4, shuffle = false, quiet = true }
wick.core.predict(model, a.batch, a.trained_logits)
lora:save(model, a.saved)
lora:merge(model)
wick.core.predict(model, a.batch, a.merged_logits)
"""


# target_modules as names or as PEFT's regular expression; biases of none,
# the adapted layers, or all layers trained beside the adapters
@pytest.mark.parametrize("family,targets,bias,layers", [
    ("llama", TARGETS, "none", 6),
    ("qwen2", r".*\.(q|v)_proj", "lora_only", 4),
    ("qwen2", ["k_proj", "o_proj"], "all", 4),
])
def test_lora_matches_peft_both_ways(tmp_path, run_wick, family, targets, bias, layers):
    torch.manual_seed(0)
    base = tiny(family)
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, target_modules=targets,
                                                      bias=bias))
    with torch.no_grad():  # a trained-looking adapter: B is not zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
            if n.endswith("bias") and p.requires_grad:  # trained-looking biases too
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 73, (4, 9))
    save_file({"input_ids": ids, "labels": ids.clone()}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "r.lua", f"base={tmp_path / 'base'}", f"adapter={tmp_path / 'adapter'}",
                 f"batch={tmp_path / 'batch.safetensors'}", f"logits={tmp_path / 'logits.safetensors'}",
                 f"grads={tmp_path / 'grads.safetensors'}", f"trained_logits={tmp_path / 'trained.safetensors'}",
                 f"saved={tmp_path / 'saved'}", f"merged_logits={tmp_path / 'merged.safetensors'}", f"layers={layers}")
    total, trainable = map(int, p.stdout.split())
    want_trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    assert trainable == want_trainable and total > trainable

    model.eval()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert (load_file(tmp_path / "logits.safetensors")["output"] - out.logits.detach()).abs().max() < 1e-4
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5
    lora_grads = {n: x.grad for n, x in model.named_parameters() if x.requires_grad}
    assert bias == "none" or any(n.endswith("bias") for n in lora_grads)
    assert len([k for k in g if k.startswith("grad.")]) == len(lora_grads)  # the base is frozen
    for n, grad in lora_grads.items():
        name = "grad." + n.replace("base_model.model.", "").replace(".default", "").replace(".base_layer", "")
        torch.testing.assert_close(g[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # wick's trained adapter in PEFT: the same outputs as wick after its step
    fresh = peft.PeftModel.from_pretrained(tiny_from(tmp_path / "base"), tmp_path / "saved").eval()
    assert fresh.peft_config["default"].bias == bias
    trained = load_file(tmp_path / "trained.safetensors")["output"]
    with torch.no_grad():
        assert (fresh(input_ids=ids).logits - trained).abs().max() < 1e-4
    assert not torch.allclose(trained, out.logits.detach(), atol=1e-3)  # the step changed something
    # merged into the base: the same outputs
    assert (load_file(tmp_path / "merged.safetensors")["output"] - trained).abs().max() < 1e-4


def tiny_from(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def test_unknown_targets_are_an_error(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("decoder_lm", { vocab_size = 20, hidden_size = 16, intermediate_size = 16, layers = 1, heads = 2 })\n'
        'wick.optim("lora", { target_modules = { "qkv" } }):apply(m)\n')
    p = run_wick("run", tmp_path / "r.lua", check=False)
    assert p.returncode == 1
    assert "r.lua:3: optim 'lora': target_modules matched none of the model's linear layers" in p.stderr
    assert "model.layers.0.self_attn.q_proj" in p.stderr


def test_a_bad_target_pattern_is_named(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'wick.optim("lora", { target_modules = { "re:(q|v" } })\n')
    p = run_wick("run", tmp_path / "r.lua", check=False)
    assert p.returncode == 1
    assert "r.lua:2:" in p.stderr and "target_modules: 're:(q|v' is not a valid regular expression" in p.stderr, p.stderr
