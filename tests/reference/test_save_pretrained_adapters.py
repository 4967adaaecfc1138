"""wick.save_pretrained of a model that is not plain float weights, against
transformers and PEFT: 4-bit NF4 layers (quantize = "nf4", qlora) are written
dequantized to the model's dtype, and a model carrying LoRA adapters is saved
as the recipe chooses: merge = true, one model with the adapters folded in,
which transformers loads alone; merge = false, the adapters alone as PEFT
saves them, which peft.PeftModel.from_pretrained loads over the base. Each
gives the logits of the model in wick's memory."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
local opts = { path = a.base }
if a.nf4 == true then opts.quantize = "nf4"; opts.quantize_block = 32 end
local model = wick.model("decoder_lm", opts)
if a.adapter then
  -- qlora quantizes the layers it adapts (blocks of 32), products in fp32
  local lora = wick.optim(a.qlora == true and "qlora" or "lora", a.qlora == true and { compute_dtype = "fp32", block_size = 32 } or {})
  lora:load(model, a.adapter)
end
wick.core.predict(model, a.batch, a.logits)
if a.merge == nil then wick.save_pretrained(model, a.out) else wick.save_pretrained(model, a.out, { merge = a.merge }) end
-- the model in memory is left as it was
wick.core.predict(model, a.batch, a.after)
"""

KW = dict(vocab_size=73, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, tie_word_embeddings=False)


def base_folder(tmp_path, dtype):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).to(dtype).eval()
    m.save_pretrained(tmp_path / "base", safe_serialization=True)
    return m


def adapter_folder(tmp_path, base):
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # a trained-looking adapter: B is not zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    return model


def run(tmp_path, run_wick, **args):
    ids = torch.randint(0, 73, (3, 11), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    extra = [f"{k}={v}" for k, v in args.items()]
    run_wick("run", tmp_path / "r.lua", f"base={tmp_path / 'base'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}", f"after={tmp_path / 'after.safetensors'}",
             f"out={tmp_path / 'out'}", *extra)
    logits = load_file(tmp_path / "logits.safetensors")["output"].float()
    assert torch.equal(load_file(tmp_path / "after.safetensors")["output"].float(), logits)
    return ids, logits


def worst(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_nf4_model_is_saved_dequantized_to_its_dtype_and_transformers_gives_its_logits(tmp_path, run_wick, dtype):
    original = base_folder(tmp_path, dtype)
    ids, logits = run(tmp_path, run_wick, nf4="true")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not [n for n in saved if ".nf4." in n]
    q = saved["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == dtype and q.shape == (64, 64)
    # the 4-bit weights, not the float ones the model was read from: 16 levels per block of 32
    assert not torch.equal(q, original.model.layers[0].self_attn.q_proj.weight.detach())
    assert all(len(torch.unique(b)) <= 16 for b in q.float().reshape(-1, 32))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=dtype).eval()
    assert loaded.dtype == dtype
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        before = original(input_ids=ids).logits
    # wick's 4-bit products run in bf16: against transformers' products of the
    # same weights, bf16 rounding (measured 1.9e-3 in fp32, 0 in bf16, with
    # ATEN_CPU_CAPABILITY avx512 and avx2); the float model it was read from is
    # 0.073 away, which the weights were before quantization
    err, quant_err = worst(got, logits), worst(before, logits)
    assert err < 0.03, (err, quant_err)
    assert quant_err > 3 * err, (err, quant_err)


def test_merge_true_folds_the_adapters_in_and_transformers_gives_the_peft_logits(tmp_path, run_wick):
    base = base_folder(tmp_path, torch.float32)
    want = adapter_folder(tmp_path, base)
    ids, logits = run(tmp_path, run_wick, adapter=tmp_path / "adapter", merge="true")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not [n for n in saved if "lora" in n]
    assert not (tmp_path / "out" / "adapter_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        peft_logits = want(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert worst(logits, peft_logits) < 1e-4
    assert worst(got, peft_logits) < 1e-4
    with want.disable_adapter(), torch.no_grad():  # the adapters change the logits: they are in the saved weights
        assert worst(want(input_ids=ids).logits, peft_logits) > 0.1


def test_merge_false_writes_the_adapters_as_peft_does_and_peft_loads_them_over_the_base(tmp_path, run_wick):
    base = base_folder(tmp_path, torch.float32)
    want = adapter_folder(tmp_path, base)
    ids, logits = run(tmp_path, run_wick, adapter=tmp_path / "adapter", merge="false")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "base") and cfg["r"] == 4 and cfg["lora_alpha"] == 12
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    loaded = peft.PeftModel.from_pretrained(fresh, out).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        peft_logits = want(input_ids=ids).logits
    assert worst(got, logits) < 1e-4 and worst(got, peft_logits) < 1e-4
    # base_model_name_or_path names the base: PEFT's auto class loads both
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert worst(auto(input_ids=ids).logits, logits) < 1e-4


def test_a_qlora_model_merged_is_saved_as_one_float_model_with_its_logits(tmp_path, run_wick):
    base = base_folder(tmp_path, torch.float32)
    adapter_folder(tmp_path, base)
    ids, logits = run(tmp_path, run_wick, adapter=tmp_path / "adapter", merge="true", qlora="true")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not [n for n in saved if "lora" in n or ".nf4." in n]
    down = saved["model.layers.1.mlp.down_proj.weight"]
    assert down.dtype == torch.float32
    # the 4-bit base with the adapter added: not the float base's weights plus the adapter
    with torch.no_grad():
        layer = base.model.layers[1].mlp.down_proj  # PEFT put its layer in place
        float_merged = layer.base_layer.weight + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 3
    assert 1e-3 < worst(down, float_merged) < 0.1  # measured 8.4e-3
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    # compute_dtype fp32: the same products up to fp32 reassociation
    assert worst(got, logits) < 1e-3
