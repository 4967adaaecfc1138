"""A fresh decoder_lm initialises as transformers' LlamaForCausalLM /
Qwen2ForCausalLM of the same config: every parameter's mean and standard
deviation match the transformers model's (normal(0, initializer_range) for
linear and embedding weights, zero biases, unit norms), initializer_range
read from the options and written to config.json."""
import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
wick.seed(3)
local m = wick.model("decoder_lm", { family = a.family, vocab_size = 512, hidden_size = 128, intermediate_size = 256,
  layers = 2, heads = 4, kv_heads = 2, tie_embeddings = a.tie, initializer_range = a.range })
wick.save_pretrained(m, a.out)
"""


@pytest.mark.parametrize("family,tie,rng", [("llama", False, 0.02), ("qwen2", True, 0.05)])
def test_fresh_decoder_statistics_match_transformers(tmp_path, run_wick, family, tie, rng):
    (tmp_path / "r.lua").write_text(RECIPE)
    out = tmp_path / "m"
    run_wick("run", tmp_path / "r.lua", f"family={family}", f"tie={str(tie).lower()}", f"range={rng}", f"out={out}")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["initializer_range"] == pytest.approx(rng)
    ours = load_file(out / "model.safetensors")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).float()
    theirs = dict(ref.state_dict())
    for name, t in ours.items():
        r = theirs[name].float()
        t = t.float()
        if r.numel() < 1000:  # norms and biases: exactly their constants
            assert torch.equal(t, r), name
            continue
        assert abs(t.std().item() - r.std().item()) < 0.05 * r.std().item(), name
        assert abs(t.mean().item() - r.mean().item()) < 0.1 * r.std().item(), name
    assert set(ours) <= set(theirs)
