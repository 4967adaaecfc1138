"""Loading a Hugging Face folder into decoder_lm: the dtype config.json gives
(torch_dtype, or dtype) must be one the model is built in; quantize and
quantize_block are checked before anything is read, a block size that does
not divide a layer is refused naming the layer, and qlora over a model
quantized on load refuses another block_size, naming the layer and both."""
from harness import Case
from hf_files import write_decoder

CFG = r"decoder_lm: m/config\.json: "


def recipe(body, **changes):
    def setup(d):
        write_decoder(d / "m", **changes)
        (d / "r.lua").write_text('local wick = require "wick"\n' + body)
    return setup


def load(name, body, message, **changes):
    return Case(name, ["run", "r.lua"], message, setup=recipe(body, **changes))


MODEL = 'local m = wick.model("decoder_lm", {{ path = "m"{} }})\n'

FRESH = ('local m = wick.model("decoder_lm", {{ family = "{}", vocab_size = 32, hidden_size = 16, '
         'intermediate_size = 32, layers = 2, heads = 2{} }})\n')

CASES = [
    load("sliding_window for a family without one from options", FRESH.format("qwen2", ", sliding_window = 4"),
         r"r\.lua:2: model 'decoder_lm' \(.*\) failed to build: option 'sliding_window': family 'qwen2' has no "
         r"sliding window made from options, expected it with family mistral, phi3, gemma2 or gemma3_text"),
    load("sliding_window 0 for gemma2", FRESH.format("gemma2", ", sliding_window = 0"),
         r"r\.lua:2: model 'decoder_lm': option 'sliding_window': expected a value >= 1, got integer 0"),
    load("family gemma", FRESH.format("gemma", ""),
         r"r\.lua:2: model 'decoder_lm': option 'family': expected one of .*gemma3_text.*, got string \"?gemma"),
    Case("torch_dtype int8", ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"],
         CFG + r"torch_dtype is \"int8\", expected float32, bfloat16 or float16",
         setup=lambda d: write_decoder(d / "m", torch_dtype="int8")),
    Case("dtype a number", ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"], CFG + r"dtype is 16, expected a string",
         setup=lambda d: write_decoder(d / "m", dtype=16)),
    load("quantize int4", MODEL.format(', quantize = "int4"'),
         r"r\.lua:2: model 'decoder_lm': option 'quantize': expected one of .*nf4.*, got string \"?int4"),
    load("quantize_block 1", MODEL.format(', quantize = "nf4", quantize_block = 1'),
         r"r\.lua:2: model 'decoder_lm': option 'quantize_block': expected a value >= 2, got integer 1"),
    load("quantize_block not dividing a layer", MODEL.format(', quantize = "nf4", quantize_block = 48'),
         r"r\.lua:2: model 'decoder_lm' \(.*decoder_lm\.so\) failed to build: decoder_lm: quantize_block 48 does not divide layer model\.layers\.0\.self_attn\.q_proj's 64 "
         r"weights, expected a block size that divides every linear layer's weight count"),
    load("qlora block_size against quantize_block",
         MODEL.format(', quantize = "nf4", quantize_block = 16')
         + 'wick.optim("qlora", { r = 2, block_size = 32 }):apply(m)\n',
         r"r\.lua:3: optim 'qlora': layer model\.layers\.0\.self_attn\.q_proj was quantized on load in blocks of 16 "
         r"\(the model's quantize_block\), block_size is 32, expected the same block size \(or block_size left out\)"),
]
