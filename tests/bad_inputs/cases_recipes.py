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
]
