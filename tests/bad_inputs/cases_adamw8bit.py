"""The 8-bit optimizer (optim `adamw8bit`): its options out of range, and a
checkpoint whose 8-bit state was made with another block size, refused in
words before any step."""
import os
import subprocess

from harness import WICK, Case


def option_case(name, opts, message):
    def setup(d):
        (d / "recipe.lua").write_text(f"local wick = require 'wick'\nwick.optim('adamw8bit', {{ {opts} }})\n")
    return Case(name, ["run", "recipe.lua"], message, setup=setup)


RESUME = """local wick = require 'wick'
local data = wick.data('synthetic', { size = 64, inputs = 64, classes = 4, seed = 1 })
local model = wick.model('mlp', { inputs = 64, hidden = { 128 }, outputs = 4 })
wick.train { model = model, data = data, optim = wick.optim('adamw8bit', { block_size = wick.args.block }),
  micro_batch = 16, max_steps = wick.args.steps, out = 'out', resume = wick.args.resume or false, quiet = true }
"""


def resume_setup(d):
    (d / "recipe.lua").write_text(RESUME)
    subprocess.run([WICK, "run", "recipe.lua", "block=256", "steps=2"], cwd=d, check=True, capture_output=True,
                   env=dict(os.environ), timeout=120)


CASES = [
    option_case("betas of three numbers", "betas = { 0.9, 0.99, 0.999 }",
                r"recipe\.lua:2: optim 'adamw8bit' \(.*adamw8bit\.so\) failed to build: optim 'adamw8bit': option 'betas': "
                r"expected 2 numbers, got 3"),
    option_case("beta of 1", "betas = { 0.9, 1.0 }",
                r"recipe\.lua:2: optim 'adamw8bit' \(.*adamw8bit\.so\) failed to build: optim 'adamw8bit': option 'betas': "
                r"expected values in \[0, 1\), got \{0\.9, 1\}"),
    option_case("block_size below 16", "block_size = 8",
                r"recipe\.lua:2: optim 'adamw8bit': option 'block_size': expected a value in \[16, 65536\], got integer 8"),
    option_case("fractional block_size", "block_size = 256.5",
                r"recipe\.lua:2: optim 'adamw8bit': option 'block_size': expected integer, got number 256\.5"),
    option_case("negative min_8bit_size", "min_8bit_size = -1",
                r"recipe\.lua:2: optim 'adamw8bit': option 'min_8bit_size': expected a value >= 0, got integer -1"),
    option_case("chunk_size of 0", "chunk_size = 0",
                r"recipe\.lua:2: optim 'adamw8bit': option 'chunk_size': expected a value >= 1, got integer 0"),
    Case("resume with another block_size", ["run", "recipe.lua", "block=128", "steps=4", "resume=true"],
         r"optim 'adamw8bit': state '0\.weight\.exp_avg\.absmax': expected 64 elements of Float, got 32 of Float "
         r"\(another block_size\?\)",
         setup=resume_setup, may_write=["out/**", "runs", "runs/**"]),
]
