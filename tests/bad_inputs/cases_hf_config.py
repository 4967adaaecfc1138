"""Hugging Face folders: config.json fields of the wrong JSON type or out of
range (an integer given as 32.5 or 32.0, as transformers refuses; zero heads
or layers; a width that would not fit in memory), and shard indexes that name
files outside the folder or files that are not there. Each message names the
file and the key."""
import json

from harness import Case
from hf_files import CONFIG, decoder_tensors, tensors_bytes, write_decoder

CFG = r"decoder_lm: m/config\.json: "


def config(**changes):
    return lambda d: write_decoder(d / "m", **changes)


def gen(name, setup, message, rc=1):
    return Case(name, ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"], message, setup=setup, rc=rc)


def sharded(weight_map=None, shards=("a.safetensors", "b.safetensors"), extra=None):
    """A folder with its weights split over two shards and an index naming them
    (weight_map entries replaced by `weight_map`); `extra` runs on the folder."""
    def setup(d):
        m = d / "m"
        write_decoder(m)
        (m / "model.safetensors").unlink()
        tensors = decoder_tensors()
        names = list(tensors)
        half = {0: names[: len(names) // 2], 1: names[len(names) // 2:]}
        wm = {}
        for i, shard in enumerate(shards):
            (m / shard).write_bytes(tensors_bytes({n: tensors[n] for n in half[i]}))
            wm.update({n: shard for n in half[i]})
        wm.update(weight_map or {})
        (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        if extra:
            extra(d)
    return setup


def elsewhere(d):
    """Another model's weights beside the folder, which an index must not reach."""
    write_decoder(d / "other")


CASES = [
    gen("hidden_size 32.5", config(hidden_size=32.5), CFG + r"hidden_size is 32\.5, expected an integer of at least 1"),
    gen("hidden_size 8.0", config(hidden_size=8.0), CFG + r"hidden_size is 8\.0, expected an integer of at least 1"),
    gen("hidden_size a string", config(hidden_size="8"), CFG + r"hidden_size is \"8\", expected an integer"),
    gen("hidden_size missing", config(hidden_size=...), CFG + r"hidden_size is missing, expected an integer"),
    gen("num_attention_heads 0", config(num_attention_heads=0), CFG + r"num_attention_heads is 0, expected an integer of at least 1"),
    gen("num_hidden_layers -1", config(num_hidden_layers=-1), CFG + r"num_hidden_layers is -1, expected an integer of at least 1"),
    gen("num_hidden_layers 0", config(num_hidden_layers=0), CFG + r"num_hidden_layers is 0, expected an integer of at least 1"),
    gen("vocab_size 0", config(vocab_size=0), CFG + r"vocab_size is 0, expected an integer of at least 1"),
    gen("num_key_value_heads 0", config(num_key_value_heads=0), CFG + r"num_key_value_heads is 0, expected an integer of at least 1"),
    gen("huge hidden_size", config(hidden_size=2 ** 40, num_attention_heads=2 ** 20),
        CFG + r"vocab_size 260, hidden_size 1099511627776, intermediate_size 16 and num_hidden_layers 1 make (\d+|more than 2\^64) "
              r"parameters, which need .* in fp32, more than this machine's .* of memory and swap"),
    gen("parameter count past 2^64", config(hidden_size=2 ** 62, num_attention_heads=2, vocab_size=2 ** 62),
        CFG + r".* make more than 2\^64 parameters, which need more than 2\^64 bytes in fp32"),
    gen("hidden_size not a multiple of the heads", config(hidden_size=10, num_attention_heads=4),
        CFG + r"hidden_size 10 is not a multiple of num_attention_heads 4, expected a width that the heads divide"),
    gen("heads not a multiple of the key/value heads", config(num_attention_heads=2, num_key_value_heads=3, hidden_size=8),
        CFG + r"num_attention_heads 2 is not a multiple of num_key_value_heads 3"),
    gen("odd head_dim", config(head_dim=3), CFG + r"head_dim is 3|the head size 3 .* is odd"),
    gen("tie_word_embeddings a string", config(tie_word_embeddings="yes"), CFG + r"tie_word_embeddings is \"yes\", expected true or false"),
    gen("rms_norm_eps a string", config(rms_norm_eps="small"), CFG + r"rms_norm_eps is \"small\", expected a number of at least 0"),
    gen("rope_theta negative", config(rope_theta=-1.0), CFG + r"rope_theta is -1\.0, expected a number above 0"),
    gen("model_type unknown", config(model_type="gpt2"),
        CFG + r"model_type is \"gpt2\", expected llama, mistral, qwen2, qwen3, phi3, gemma2 or gemma3_text \(the "
              r"decoders wick reads\)"),
    # Gemma 3's vision-language folder (its text model alone, gemma3_text, loads)
    gen("model_type gemma3", config(model_type="gemma3"),
        CFG + r"model_type is \"gemma3\", expected llama, mistral, qwen2, qwen3, phi3, gemma2 or gemma3_text"),
    gen("gemma2 hidden_activation", config(model_type="gemma2", hidden_activation="gelu"),
        CFG + r"hidden_activation is \"gelu\", expected gelu_pytorch_tanh"),
    gen("rope_parameters a list", config(rope_parameters=[1]), CFG + r"rope_parameters is \[1\], expected an object"),
    # rotary scalings: the types wick computes, each with its own fields
    gen("rope_scaling longrope", config(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
        CFG + r"rope_scaling\.rope_type is \"longrope\", expected default, linear, dynamic, llama3 or yarn"),
    gen("rope_scaling a legacy unknown type", config(rope_scaling={"type": "su", "factor": 2.0}),
        CFG + r"rope_scaling\.type is \"su\", expected default, linear, dynamic, llama3 or yarn"),
    gen("rope_scaling factor 0", config(rope_scaling={"type": "linear", "factor": 0}),
        CFG + r"rope_scaling\.factor is 0, expected a number above 0"),
    gen("rope_scaling linear without factor", config(rope_scaling={"rope_type": "linear"}),
        CFG + r"rope_scaling\.factor is missing, expected a number above 0"),
    gen("rope_scaling a field of another type", config(rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                                     "beta_fast": 8}),
        CFG + r"rope_scaling\.beta_fast is not a field of rope_type linear \(expected rope_type, type, rope_theta, factor\)"),
    gen("rope_parameters llama3 high below low", config(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
        CFG + r"rope_parameters\.high_freq_factor is 1\.0, expected a number above low_freq_factor"),
    gen("rope_parameters yarn truncate a string", config(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "truncate": "yes"}),
        CFG + r"rope_parameters\.truncate is \"yes\", expected true or false"),
    gen("rope_scaling a partial rotary factor", config(rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                                     "partial_rotary_factor": 0.5}),
        CFG + r"rope_scaling\.partial_rotary_factor is not a field of rope_type linear"),
    gen("config.json is a list", lambda d: (write_decoder(d / "m"), (d / "m" / "config.json").write_text("[1, 2]")),
        CFG + r"the file is \[1,2\], expected a JSON object"),
    gen("config.json is not JSON", lambda d: (write_decoder(d / "m"), (d / "m" / "config.json").write_text("{'a': 1}")),
        r"m/config\.json is not valid JSON: .*syntax error"),
    gen("config.json is a folder", lambda d: (write_decoder(d / "m"), (d / "m" / "config.json").unlink(),
                                              (d / "m" / "config.json").mkdir()),
        r"m/config\.json is a directory, expected a JSON file"),
    gen("index names an absolute path", sharded({"lm_head.weight": "OTHER"}, extra=lambda d: (
        elsewhere(d), _rewrite(d, "OTHER", str((d / "other" / "model.safetensors").resolve())))),
        r"decoder_lm: m/model\.safetensors\.index\.json: weight_map\.lm_head\.weight names the shard \"/.*, "
        r"expected a file inside the model folder"),
    gen("index climbs out of the folder", sharded({"lm_head.weight": "../../../../etc/passwd"}),
        r"m/model\.safetensors\.index\.json: weight_map\.lm_head\.weight names the shard \"\.\./\.\./\.\./\.\./etc/passwd\", "
        r"expected a file inside the model folder \(a relative path without \.\./\)"),
    gen("index climbs out and back in", sharded({"lm_head.weight": "../m/b.safetensors"}),
        r"weight_map\.lm_head\.weight names the shard \"\.\./m/b\.safetensors\", expected a file inside the model folder"),
    gen("index names a missing shard", sharded({"lm_head.weight": "model-00003-of-00003.safetensors"}),
        r"m/model\.safetensors\.index\.json: weight_map\.lm_head\.weight is in the shard "
        r"\"model-00003-of-00003\.safetensors\", which does not exist in m"),
    gen("index shard is a number", sharded({"lm_head.weight": 3}),
        r"weight_map\.lm_head\.weight is 3, expected the name of a \.safetensors file in the folder"),
    gen("index weight_map missing", lambda d: (write_decoder(d / "m"), (d / "m" / "model.safetensors").unlink(),
                                               (d / "m" / "model.safetensors.index.json").write_text('{"metadata": {}}')),
        r"m/model\.safetensors\.index\.json: weight_map is missing, expected an object"),
    gen("tensor in two shards", sharded(extra=lambda d: (d / "m" / "b.safetensors").write_bytes(
        tensors_bytes(decoder_tensors()))),
        r"decoder_lm: tensor '.*' is in both m/[ab]\.safetensors and m/[ab]\.safetensors, expected each tensor in one shard"),
    # transformers leaves a tied head untied when the file holds a different lm_head.weight, and says so
    Case("tied embeddings with a separate lm_head.weight", ["run", "r.lua"],
         r"^wick: decoder_lm: m: tie_word_embeddings is true but the weights hold a lm_head\.weight other than "
         r"model\.embed_tokens\.weight: it stays a separate output head, as transformers leaves it$", rc=0,
         setup=lambda d: (write_decoder(d / "m", weights=tensors_bytes(decoder_tensors(dict(CONFIG, tie_word_embeddings=False))),
                                        tie_word_embeddings=True),
                          (d / "r.lua").write_text('local wick = require "wick"\n'
                                                   'local m = wick.model("decoder_lm", { path = "m" })\n'
                                                   'print(m.tie_embeddings)\n'))),
]


# Qwen2's sliding window (layers from max_window_layers on, or those
# layer_types names, see the last sliding_window positions): layer_types must
# name each layer's kind; Phi-3's long-context rotary scaling is refused.
QWEN = dict(model_type="qwen2", use_sliding_window=True, sliding_window=4)

CASES += [
    gen("qwen2 layer_types of the wrong length", config(**QWEN, layer_types=["full_attention", "sliding_attention"]),
        CFG + r"layer_types is \[.*\], expected one entry per layer \(num_hidden_layers 1\), not 2"),
    gen("mistral sliding_window 0", config(model_type="mistral", sliding_window=0),
        CFG + r"sliding_window is 0, expected an integer of at least 1"),
    gen("phi3 longrope", config(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0],
                                                               "long_factor": [1.0]}),
        CFG + r"rope_scaling\.type is longrope: Phi-3's long-context rotary scaling \(longrope, su\) is not supported "
              r"by wick, expected rope_scaling null"),
    gen("phi3 partial_rotary_factor above 1", config(model_type="phi3", partial_rotary_factor=1.5),
        CFG + r"partial_rotary_factor is 1\.5, expected a number above 0 and at most 1"),
    gen("qwen2 layer_types of another kind", config(**QWEN, layer_types=["chunked_attention"]),
        CFG + r"layer_types is \[\"chunked_attention\"\], expected a list of full_attention and sliding_attention"),
    # float64 weights were built as fp32 without a word
    gen("torch_dtype float64", config(torch_dtype="float64"),
        CFG + r"torch_dtype is \"float64\", expected float32, bfloat16 or float16 \(the dtypes wick builds a decoder in\)"),
    Case("vit torch_dtype float64", ["run", "r.lua"],
         r"r\.lua:2: .*v/config\.json: torch_dtype is \"float64\", expected float32, bfloat16 or float16 \(the dtypes wick "
         r"loads weights in\)",
         setup=lambda d: ((d / "v").mkdir(), (d / "v" / "config.json").write_text(json.dumps(
             {"model_type": "vit", "torch_dtype": "float64"})),
                          (d / "r.lua").write_text('local wick = require "wick"\n'
                                                   'wick.model("vit", { path = "v", classes = 2 })\n'))),
    Case("llava torch_dtype float64", ["run", "r.lua"],
         r"r\.lua:2: .*vlm: l/config\.json: torch_dtype is \"float64\", expected float32, bfloat16 or float16",
         setup=lambda d: ((d / "l").mkdir(), (d / "l" / "config.json").write_text(json.dumps(
             {"model_type": "llava", "torch_dtype": "float64", "vision_config": {"model_type": "clip_vision_model"},
              "text_config": CONFIG})),
                          (d / "r.lua").write_text('local wick = require "wick"\n'
                                                   'wick.model("vlm", { path = "l" })\n'))),
]


def _rewrite(d, placeholder, path):
    index = d / "m" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace(placeholder, path))
