"""Recipes and the command line: the recipe file, its arguments, its errors."""
from harness import Case


def recipe(text):
    def setup(d):
        (d / "recipe.lua").write_text(text)
    return setup


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
]
