"""Small Hugging Face files for the bad-input cases, written without torch:
safetensors files (as bytes, so a case can break any part of them), a tiny
LLaMA folder (config.json + model.safetensors), a byte-level BPE
tokenizer.json and a PEFT LoRA adapter folder."""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path

# the tiny decoder: bytes tokenizer ids (0-256) fit its vocabulary
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 260, "hidden_size": 8,
    "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


def header_bytes(header: dict | str | bytes) -> bytes:
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    return header


def safetensors_bytes(header, data: bytes = b"") -> bytes:
    """8-byte little-endian length, the header as given, then `data`."""
    h = header_bytes(header)
    return struct.pack("<Q", len(h)) + h + data


def tensors_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    """A valid file of F32 tensors {name: (shape, [values])}, in the given order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return safetensors_bytes(header, data)


def decoder_tensors(config: dict = CONFIG, seed: int = 0) -> dict:
    rnd = random.Random(seed)
    V, H, I = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = H // heads

    def t(*shape):
        n = 1
        for d in shape:
            n *= d
        return (shape, [rnd.uniform(-0.5, 0.5) for _ in range(n)])

    out = {"model.embed_tokens.weight": t(V, H)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = t(heads * hd, H)
        out[p + "self_attn.k_proj.weight"] = t(kv * hd, H)
        out[p + "self_attn.v_proj.weight"] = t(kv * hd, H)
        out[p + "self_attn.o_proj.weight"] = t(H, heads * hd)
        out[p + "mlp.gate_proj.weight"] = t(I, H)
        out[p + "mlp.up_proj.weight"] = t(I, H)
        out[p + "mlp.down_proj.weight"] = t(H, I)
        out[p + "input_layernorm.weight"] = ((H,), [1.0] * H)
        out[p + "post_attention_layernorm.weight"] = ((H,), [1.0] * H)
    out["model.norm.weight"] = ((H,), [1.0] * H)
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = t(V, H)
    return out


def write_decoder(d: Path, config: dict | None = None, weights: bytes | None = None, **changes):
    """d/config.json (CONFIG with `changes`; a key set to ... is dropped) and d/model.safetensors."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIG if config is None else config)
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    if weights is None:
        weights = tensors_bytes(decoder_tensors(CONFIG if config is None else config), {"format": "pt"})
    (d / "model.safetensors").write_bytes(weights)


def byte_level_alphabet() -> list:
    """GPT-2's printable characters for the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tokenizer_json() -> dict:
    """A small byte-level BPE tokenizer.json as the tokenizers library writes it."""
    vocab = {c: i for i, c in enumerate(sorted(byte_level_alphabet()))}
    for t in ("he", "ll", "hell", "Ġw"):
        vocab[t] = len(vocab)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": ["h e", "l l", "he ll", "Ġ w"]},
    }


def write_adapter(d: Path, r: int = 4, weights_r: int | None = None, hidden: int = 8, **changes):
    """A PEFT LoRA folder for the tiny decoder's q_proj and v_proj: adapter_config.json
    (with `changes`) and adapter_model.safetensors of rank `weights_r` (default r)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 8, "lora_dropout": 0.0,
           "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
           "inference_mode": False, "use_rslora": False, "modules_to_save": None}
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    k = r if weights_r is None else weights_r
    tensors = {}
    for m in ("q_proj", "v_proj"):
        p = f"base_model.model.model.layers.0.self_attn.{m}"
        tensors[p + ".lora_A.weight"] = ((k, hidden), [0.01] * (k * hidden))
        tensors[p + ".lora_B.weight"] = ((hidden, k), [0.0] * (k * hidden))
    (d / "adapter_model.safetensors").write_bytes(tensors_bytes(tensors, {"format": "pt"}))
