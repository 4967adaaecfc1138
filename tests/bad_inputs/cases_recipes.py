"""Recipes and the command line: the recipe file, its arguments, its errors."""
from harness import Case


def recipe(text):
    def setup(d):
        (d / "recipe.lua").write_text(text)
    return setup


TRAIN = ("local wick = require 'wick'\n"
         "local d = wick.data('synthetic', {{ size = 8, inputs = 4, classes = 2 }})\n"
         "local m = wick.model('mlp', {{ inputs = 4, hidden = {{ 4 }}, outputs = 2 }})\n"
         "local o = wick.optim('sgd', {{ lr = 0.1 }})\n"
         "wick.train {{ model = m, data = d, optim = o, micro_batch = 4, max_steps = 1, quiet = true, {} }}\n")

CASES = [
    Case("missing recipe", ["run", "nothere.lua"], r"recipe nothere\.lua does not exist"),
    Case("syntax error", ["run", "recipe.lua"], r"recipe\.lua:2: .*unexpected symbol",
         setup=recipe("local wick = require 'wick'\nlocal x = = 1\n")),
    Case("runtime error", ["run", "recipe.lua"], r"recipe\.lua:2: boom", setup=recipe("local wick = require 'wick'\nerror('boom')\n")),
    Case("unknown plugin", ["run", "recipe.lua"], r"recipe\.lua:2: unknown plugin 'mpl'",
         setup=recipe("local wick = require 'wick'\nwick.model('mpl', {})\n")),
    Case("unknown option", ["run", "recipe.lua"], r"model 'mlp': unknown option 'hiden'",
         setup=recipe("local wick = require 'wick'\nwick.model('mlp', { hiden = 3 })\n")),
    Case("unknown subcommand", ["frobnicate"], r"frobnicate", rc=2),
    # wrote nothing and exited 0 before
    Case("out is empty", ["run", "recipe.lua"], r"recipe\.lua:5: wick\.train: option 'out': expected a run folder's path",
         setup=recipe(TRAIN.format("out = '', save_every = 1"))),
    Case("loss_scale a list", ["run", "recipe.lua"], r"loss_scale: expected a number or a table of named keys",
         setup=recipe(TRAIN.format("precision = 'fp16-mixed', loss_scale = { 1, 2 }"))),
    Case("seed past 2^53", ["run", "recipe.lua"], r"option 'seed': expected integer, got number 9007199254740992 "
         r"\(past 2\^53", setup=recipe(TRAIN.format("seed = 2^53 + 1"))),
    # five lines of LibTorch's text from the first tensor moved there before
    Case("a CUDA device this machine cannot use", ["run", "recipe.lua"],
         r"recipe\.lua:5: wick\.train: option device 'cuda:7': (no CUDA device can be used|expected cuda or cuda:N)",
         setup=recipe(TRAIN.format("device = 'cuda:7'"))),
    # read as 12 bytes before
    Case("plan device memory without a unit", ["plan", "recipe.lua", "--device-memory", "12"],
         r"--device-memory: '12' has no unit", rc=2, setup=recipe(TRAIN.format("seed = 1"))),
] + [
    # trainer:evaluate's micro-batch: a whole number >= 1
    Case(f"trainer:evaluate micro_batch {bad}", ["run", "recipe.lua"],
         r"recipe\.lua:5: trainer:evaluate: micro_batch: expected a whole number >= 1, got " + shown,
         setup=recipe("local wick = require 'wick'\n"
                      "local data = wick.data('synthetic', { size = 8, inputs = 4, classes = 2 })\n"
                      "local model = wick.model('mlp', { inputs = 4, hidden = { 4 }, outputs = 2 })\n"
                      "local trainer = wick.trainer { model = model, optim = wick.optim('sgd', { lr = 0.1 }) }\n"
                      f"trainer:evaluate(data, {bad})\n"))
    for bad, shown in [("0", "0"), ("1.5", r"1\.5"), ("-2", "-2"), ("1/0", "inf")]
] + [
    # wick.loader's options go through wick.train's declarations (2.5 was truncated to 2 before)
    Case(f"wick.loader {name}", ["run", "recipe.lua"], r"recipe\.lua:3: wick\.loader: " + shown,
         setup=recipe("local wick = require 'wick'\n"
                      "local data = wick.data('synthetic', { size = 8, inputs = 4, classes = 2 })\n"
                      f"local loader = wick.loader(data, {{ {given} }})\n"))
    for name, given, shown in [
        ("micro_batch 2.5", "micro_batch = 2.5", r"option 'micro_batch': expected integer, got number 2\.5"),
        ("micro_batch 0", "micro_batch = 0", r"option 'micro_batch': expected a value >= 1, got integer 0"),
        ("micro_batch a string", "micro_batch = 'x'", r"option 'micro_batch': expected integer, got string \"x\""),
        ("accumulate -1", "accumulate = -1", r"option 'accumulate': expected a value >= 1, got integer -1"),
        ("workers 1.5", "workers = 1.5", r"option 'workers': expected integer, got number 1\.5"),
        ("unknown key", "micro_bach = 2", r"unknown option 'micro_bach' \(known options: micro_batch, "),
    ]
]
