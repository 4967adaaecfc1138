"""Memory caps: WICK_CPU_MEMORY_LIMIT's value, and a cap below what a step needs."""
from harness import Case

SMALL = """local wick = require 'wick'
local data = wick.data('synthetic', { size = 64, inputs = 32, classes = 4 })
local model = wick.model('mlp', { inputs = 32, hidden = { 64 }, outputs = 4 })
wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 16, max_steps = 1 }
"""

# weights of 64 MiB: one sample's gradients alone go over a cap of 66 MiB
BIG = """local wick = require 'wick'
local data = wick.data('synthetic', { size = 64, inputs = 32, classes = 4 })
local model = wick.model('mlp', { inputs = 32, hidden = { 4096, 4096 }, outputs = 4 })
wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 16, max_steps = 1 }
"""


def recipe(text):
    def setup(d):
        (d / "recipe.lua").write_text(text)
    return setup


def limit(value, name=None):
    return Case(f"WICK_CPU_MEMORY_LIMIT={value}" if name is None else name, ["run", "recipe.lua"],
                r"WICK_CPU_MEMORY_LIMIT: expected a size", setup=recipe(SMALL), env={"WICK_CPU_MEMORY_LIMIT": value})


# a model with blocks to checkpoint (mlp: one per hidden layer)
def offload(settings):
    return recipe("local wick = require 'wick'\n"
                  "local data = wick.data('synthetic', { size = 64, inputs = 32, classes = 4 })\n"
                  "local model = wick.model('mlp', { inputs = 32, hidden = { 64, 64 }, outputs = 4 })\n"
                  "wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 16,\n"
                  f"  max_steps = 1, {settings} }}\n")


# offload_embeddings on a decoder (`model_opts`, its transforms in `then`) or an mlp
def table(model_opts=None, then="", settings="offload_embeddings = true"):
    def setup(d):
        (d / "t.txt").write_text("a small text that a decoder reads. " * 20)
        model = (f"wick.model('decoder_lm', {{ vocab_size = 300, hidden_size = 32, intermediate_size = 64, layers = 1, "
                 f"heads = 2{model_opts} }})" if model_opts is not None
                 else "wick.model('mlp', { inputs = 32, hidden = { 64 }, outputs = 4 })")
        data = ("wick.data('text', { files = { 't.txt' }, max_length = 16 })" if model_opts is not None
                else "wick.data('synthetic', { size = 64, inputs = 32, classes = 4 })")
        (d / "recipe.lua").write_text(
            f"local wick = require 'wick'\nlocal data = {data}\nlocal model = {model}\n{then}\n"
            f"wick.train {{ model = model, data = data, optim = wick.optim('sgd', {{ lr = 0.1 }}), micro_batch = 4,\n"
            f"  max_steps = 1, {settings} }}\n")
    return setup


CASES = [
    Case("offload_embeddings on a model without an input embedding", ["run", "recipe.lua"],
         r"recipe\.lua:5: .*option 'offload_embeddings': the model has no input embedding that can stay in host memory "
         r"\(its plugin names none: wick::HostLookups\); train without offload_embeddings", setup=table()),
    Case("offload_embeddings with the embedding tied to the head", ["run", "recipe.lua"],
         r"recipe\.lua:5: .*option 'offload_embeddings': .*\(its input embedding is tied to its output head "
         r"\(tie_word_embeddings\), which uses it on the device\)",
         setup=table(", tie_embeddings = true", "model:freeze('model.embed_tokens')")),
    Case("offload_embeddings with the embedding trained", ["run", "recipe.lua"],
         r"recipe\.lua:5: .*option 'offload_embeddings': model\.embed_tokens\.weight trains, and an input embedding "
         r"stays in host memory only frozen", setup=table("")),
    Case("offload_embeddings not a boolean", ["run", "recipe.lua"], r"recipe\.lua:5: .*offload_embeddings.*boolean",
         setup=table("", "", "offload_embeddings = 'yes'")),
    limit("abc"),
    limit("-1"),
    limit("1e30"),
    limit("inf"),
    limit("0x100000"),
    limit("8 parsecs"),
    Case("offload_activations without checkpointing", ["run", "recipe.lua"],
         r"recipe\.lua:4: .*option 'offload_activations': it moves the checkpointed blocks' inputs to host memory, "
         r"and checkpointing is false; set checkpointing = true",
         setup=offload("offload_activations = true")),
    Case("offload_activations not a boolean", ["run", "recipe.lua"], r"recipe\.lua:4: .*offload_activations.*boolean",
         setup=offload("checkpointing = true, offload_activations = 'yes'")),
    Case("WICK_MEMORY_PEAK_TRACE=yes", ["run", "recipe.lua"],
         r"WICK_MEMORY_PEAK_TRACE: expected 1 \(print where the peak's tensors were allocated\) or 0, got 'yes'",
         setup=recipe(SMALL), env={"WICK_MEMORY_PEAK_TRACE": "yes"}),
    Case("cap below a step even at micro_batch 1", ["run", "recipe.lua"],
         r"step 1: out of memory even at micro_batch 1 .*tensors would hold [0-9.]+ MiB .*over the cap of 66\.00 MiB",
         setup=recipe(BIG), env={"WICK_CPU_MEMORY_LIMIT": "66MiB"}),
    Case("cap below the data set", ["run", "recipe.lua"],
         r"recipe\.lua:2: data 'synthetic'.*failed to build: CPU out of memory: .*over the cap of 1\.0 KiB",
         setup=recipe(SMALL), env={"WICK_CPU_MEMORY_LIMIT": "1KiB"}),
]
