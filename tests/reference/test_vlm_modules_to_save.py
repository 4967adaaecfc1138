"""lora's modules_to_save (PEFT's option): the named modules stay trainable
after the base is frozen, train, and save with the adapter as PEFT saves
them, so PEFT loads wick's adapter and gives wick's outputs; wick loads it
back; a name that matches nothing is an error."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("decoder_lm", { path = a.base })
local lora = wick.optim("lora", { r = 4, alpha = 8, target_modules = { "q_proj", "v_proj" }, modules_to_save = { "lm_head" } })
lora:apply(model)
local total, trainable = model:parameters()
print(total, trainable)
wick.core.gradients(model, a.batch, a.grads)
wick.train { model = model, data = wick.data("tensors", { file = a.batch }), optim = wick.optim("sgd", { lr = 0.5 }),
  micro_batch = 4, shuffle = false, quiet = true }
wick.core.predict(model, a.batch, a.logits)
lora:save(model, a.saved)
-- a fresh model loads the adapter and the saved module back
local again = wick.model("decoder_lm", { path = a.base })
local l2 = wick.optim("lora", {})
l2:load(again, a.saved)
wick.core.predict(again, a.batch, a.logits2)
"""


def test_modules_to_save_train_and_round_trip_with_peft(tmp_path, run_wick):
    torch.manual_seed(0)
    kw = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float().eval()
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    ids = torch.randint(0, 53, (4, 8))
    save_file({"input_ids": ids, "labels": ids.clone()}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "r.lua", f"base={tmp_path / 'base'}", f"batch={tmp_path / 'batch.safetensors'}",
                 f"grads={tmp_path / 'g.safetensors'}", f"logits={tmp_path / 'l.safetensors'}",
                 f"saved={tmp_path / 'saved'}", f"logits2={tmp_path / 'l2.safetensors'}")
    total, trainable = map(int, p.stdout.split())
    # PEFT's count for the same config: adapters plus the whole head
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float(),
                              peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              modules_to_save=["lm_head"]))
    assert trainable == sum(x.numel() for x in ref.parameters() if x.requires_grad)
    assert trainable > 53 * 32  # the head trains
    g = load_file(tmp_path / "g.safetensors")
    assert "grad.lm_head.weight" in g and "grad.model.embed_tokens.weight" not in g

    cfg = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["lm_head"]
    saved = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in saved
    trained = load_file(tmp_path / "l.safetensors")["output"]
    # PEFT loads wick's adapter with the trained head and gives wick's outputs
    fresh = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float(),
                                           tmp_path / "saved").eval()
    with torch.no_grad():
        got = fresh(input_ids=ids).logits
        before = base(input_ids=ids).logits
    assert (got - trained).abs().max() < 1e-4
    assert not torch.allclose(saved["base_model.model.lm_head.weight"], base.lm_head.weight)  # the head moved
    assert (before - trained).abs().max() > 1e-3
    # and wick loads it back
    assert (load_file(tmp_path / "l2.safetensors")["output"] - trained).abs().max() < 1e-5


def test_modules_to_save_matching_nothing_is_an_error(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("decoder_lm", { vocab_size = 20, hidden_size = 16, intermediate_size = 16, layers = 1, heads = 2 })\n'
        'wick.optim("lora", { modules_to_save = { "multi_modal_projector" } }):apply(m)\n')
    p = run_wick("run", tmp_path / "r.lua", check=False)
    assert p.returncode != 0
    assert "modules_to_save matched no module" in p.stderr
    assert "model, lm_head" in p.stderr  # the model's modules are named
