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
# refuses the nf4.* tensors that nothing loads.
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
    Case("save_pretrained of an nf4 model", ["run", "r.lua"],
         r"r\.lua:4: save_pretrained: 7 linear layers of the model are 4-bit NF4 \(quantize = \"nf4\"\), which transformers "
         r"does not load, expected float layers: merge the adapters first",
         setup=nf4("wick.save_pretrained(m, 'out')\n")),
]

