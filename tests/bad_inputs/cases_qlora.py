"""QLoRA's 4-bit base weights: a layer whose weight count NF4 cannot store
with the recipe's block_size (not a multiple of it, or odd, which an odd
block_size lets through) is refused, naming the layer and both numbers."""
from harness import Case


def recipe(model, block):
    def setup(d):
        (d / "r.lua").write_text(
            'local wick = require "wick"\n'
            f'local m = wick.model({model})\n'
            f'wick.optim("qlora", {{ block_size = {block}, target_modules = {{ "all-linear" }} }}):apply(m)\n')
    return setup


DECODER = '"decoder_lm", { vocab_size = 260, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2 }'
# a text tower of width 3: its 3 x 3 projections hold 9 weights
ODD_CLIP = '"clip", { text_hidden_size = 3, text_heads = 1, text_intermediate_size = 3, projection_dim = 3, text_layers = 1 }'

CASES = [
    Case("block_size not dividing a layer", ["run", "r.lua"],
         r"r\.lua:3: optim 'qlora': layer model\.layers\.0\.self_attn\.q_proj has 64 weights, not a multiple of block_size 3",
         setup=recipe(DECODER, 3)),
    Case("odd block_size and an odd layer", ["run", "r.lua"],
         r"r\.lua:3: optim 'qlora': layer \S+ has 9 weights, an odd count, expected an even one",
         setup=recipe(ODD_CLIP, 3)),
]

# A model too big for this machine even as built: the size check counts the
# dtype the weights are made in and NF4's 4 bits for the linear layers (a 7 B
# model in NF4 and bf16 is about 4 GiB, and is built on a 24 GiB machine).
def huge(opts):
    def setup(d):
        (d / "r.lua").write_text('local wick = require "wick"\n'
                                 f'wick.model("decoder_lm", {{ vocab_size = 1000, hidden_size = 65536, intermediate_size = 262144, '
                                 f'layers = 64, heads = 64{opts} }})\n')
    return setup


CASES += [
    Case("decoder too big in bf16 with NF4 layers", ["run", "r.lua"],
         r"r\.lua:2: .*make \d+ parameters, which need [\d.]+ TiB in bf16 with NF4 linear layers, more than this machine's",
         setup=huge(', dtype = "bf16", quantize = "nf4"')),
    Case("decoder too big in fp32", ["run", "r.lua"],
         r"r\.lua:2: .*make \d+ parameters, which need [\d.]+ TiB in fp32, more than this machine's",
         setup=huge("")),
]

# A 4-bit model without adapters: its linear layers do not train, so plain
# training moved only the embeddings, norms and head. Refused at the first
# training forward unless something was frozen on purpose; and save_pretrained
# writes its layers dequantized, not the nf4.* tensors that nothing loads.
NF4 = ("local wick = require 'wick'\n"
       "local data = wick.data('text', { files = { 'a.txt' }, max_length = 16, cache_dir = 'none' })\n"
       "local m = wick.model('decoder_lm', { vocab_size = data.vocab_size, hidden_size = 64, intermediate_size = 128, "
       "layers = 1, heads = 2, quantize = 'nf4' })\n")
TRAIN = "local run = wick.train { model = m, data = data, optim = wick.optim('adamw', { lr = 1e-3 }), micro_batch = 1, quiet = true }\n"


def nf4(tail):
    def setup(d):
        (d / "a.txt").write_text("some text to learn from, long enough for a few samples of sixteen bytes\n")
        (d / "r.lua").write_text(NF4 + tail)
    return setup


CASES += [
    Case("nf4 model trained without adapters", ["run", "r.lua"],
         r"r\.lua:4: .*decoder_lm: quantize = \"nf4\" keeps 7 linear layers in 4 bits, which do not train, and no LoRA "
         r"adapters are on them: training would change only the embeddings, norms and head; expected adapters \(QLoRA: "
         r"wick\.optim\(\"qlora\", \{\.\.\.\}\):apply\(model\) before training\), or a freeze of what should not train "
         r"\(model:freeze\) to train the rest alone", setup=nf4(TRAIN), may_write=["runs/**"]),
    Case("nf4 model with the head alone left to train", ["run", "r.lua"], r"^trained \d+ steps$", rc=0,
         setup=nf4("m:freeze('model.*')\n" + TRAIN + "print('trained ' .. run.steps .. ' steps')\n"), may_write=["runs/**"]),
    # written dequantized (tests/reference/test_save_pretrained_adapters.py checks the logits)
    Case("save_pretrained of an nf4 model", ["run", "r.lua"], r"^model\.layers\.0\.self_attn\.q_proj\.weight float32$", rc=0,
         setup=nf4("wick.save_pretrained(m, 'out')\n"
                   "local f = io.open('out/model.safetensors', 'rb') local h = f:read(8 + 4096) f:close()\n"
                   "assert(not h:find('nf4'), 'nf4 tensors written')\n"
                   "print('model.layers.0.self_attn.q_proj.weight ' .. (h:find('q_proj.weight\":{\"dtype\":\"F32') and 'float32' or '?'))\n"),
         may_write=["out", "out/**"]),
]

# A model carrying LoRA adapters: save_pretrained asks for merge (the
# adapters folded in, or saved alone as PEFT does) rather than write lora_*
# tensors that transformers drops.
LORA = ("local wick = require 'wick'\n"
        "local m = wick.model('decoder_lm', { vocab_size = 32, hidden_size = 64, intermediate_size = 128, layers = 1, heads = 2 })\n")
APPLY = "wick.optim('lora', { r = 2, target_modules = { 'q_proj', 'v_proj' } }):apply(m)\n"


def lora(tail, adapters=True):
    def setup(d):
        (d / "r.lua").write_text(LORA + (APPLY if adapters else "") + tail)
    return setup


CASES += [
    Case("save_pretrained of a model with LoRA adapters, merge left out", ["run", "r.lua"],
         r"r\.lua:4: save_pretrained: 2 linear layers of the model carry LoRA adapters, expected merge = true \(one model "
         r"with the adapters folded into its weights, which transformers loads alone\) or merge = false \(the adapters "
         r"alone, adapter_config\.json and adapter_model\.safetensors, which peft\.PeftModel\.from_pretrained loads over "
         r"the base model\)$", setup=lora("wick.save_pretrained(m, 'out')\n")),
    Case("save_pretrained merge not a boolean", ["run", "r.lua"],
         r"r\.lua:4: save_pretrained: merge is yes, expected true \(the adapters folded into the weights\) or false "
         r"\(the adapters alone, as PEFT saves them\)$", setup=lora("wick.save_pretrained(m, 'out', { merge = 'yes' })\n")),
    Case("save_pretrained merge = false without adapters", ["run", "r.lua"],
         r"r\.lua:3: save_pretrained: merge = false saves a model's LoRA adapters alone, but the model carries none, "
         r"expected merge left out \(the whole model is saved\)$",
         setup=lora("wick.save_pretrained(m, 'out', { merge = false })\n", adapters=False)),
    Case("save_pretrained with an unknown option", ["run", "r.lua"],
         r"r\.lua:4: save_pretrained: unknown option 'merged', expected tokenizer or merge$",
         setup=lora("wick.save_pretrained(m, 'out', { merged = true })\n")),
    Case("save_pretrained after lora:merge needs no merge", ["run", "r.lua"], r"^saved$", rc=0,
         setup=lora("local l = wick.optim('lora', { r = 2 }) l:apply(m) l:merge(m)\n"
                    "wick.save_pretrained(m, 'out') print('saved')\n", adapters=False),
         may_write=["out", "out/**"]),
]

# `deferred` takes a boolean (qlora over a deferred model quantizes each
# layer as its values are made: tests/host/distributed/test_shard.py).
CASES += [
    Case("deferred not a boolean", ["run", "r.lua"],
         r"r\.lua:2: .*option 'deferred': expected boolean, got string \"yes\"",
         setup=recipe('"decoder_lm", { vocab_size = 260, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2, '
                      'deferred = "yes" }', 4)),
]
