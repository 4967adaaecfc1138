"""The language models' loss (decoder_lm and vlm's loss_chunk): labels outside
the vocabulary are refused in words, whether the head runs in chunks or whole."""
import json
import struct

from harness import Case


def i64_safetensors(tensors: dict) -> bytes:
    """A safetensors file of I64 tensors {name: (shape, [values])}."""
    header, data = {}, b""
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}q", *values)
        header[name] = {"dtype": "I64", "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def labels_case(name, label, chunk):
    def setup(d):
        ids = [1, 2, 3, 4, 5, 6, 7, 8] * 2
        labels = list(ids)
        labels[5] = label
        (d / "batch.safetensors").write_bytes(i64_safetensors({"input_ids": ([2, 8], ids), "labels": ([2, 8], labels)}))
        (d / "recipe.lua").write_text(f"""local wick = require 'wick'
local data = wick.data('tensors', {{ file = 'batch.safetensors' }})
local model = wick.model('decoder_lm', {{ vocab_size = 256, hidden_size = 16, intermediate_size = 32, layers = 1,
  heads = 2, loss_chunk = {chunk} }})
wick.train {{ model = model, data = data, optim = wick.optim('sgd', {{ lr = 0.1 }}), micro_batch = 2, max_steps = 1,
  out = 'out' }}
""")
    return Case(name, ["run", "recipe.lua"],
                rf"labels: {label} is outside the vocabulary of 256, expected -100 \(ignored\) or 0\.\.255",
                setup=setup, may_write=["out", "out/**", "runs", "runs/**"])


def option_case(name, model, value, message):
    def setup(d):
        (d / "recipe.lua").write_text(f"""local wick = require 'wick'
local model = wick.model('{model}', {{ vocab_size = 300, hidden_size = 16, intermediate_size = 32, layers = 1,
  heads = 2, loss_chunk = {value} }})
""")
    return Case(name, ["run", "recipe.lua"], message, setup=setup)


CASES = [
    option_case("negative loss_chunk", "decoder_lm", -1,
                r"recipe\.lua:2: model 'decoder_lm': option 'loss_chunk': expected a value >= 0, got integer -1"),
    option_case("fractional loss_chunk", "vlm", 2.5,
                r"recipe\.lua:2: model 'vlm': option 'loss_chunk': expected integer, got number 2\.5"),
    labels_case("label past the vocabulary, chunked head", 256, 4),
    labels_case("label past the vocabulary, whole logits", 300, 0),
    labels_case("negative label other than -100", -5, 1024),
]
