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


CASES = [
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
