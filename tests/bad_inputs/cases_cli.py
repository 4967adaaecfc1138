"""The command line of `wick run`: where the recipe goes, what it is, what a
recipe's error object says, and key=value pairs the recipe never uses."""
from harness import Case


def files(**named):
    def setup(d):
        for name, text in named.items():
            p = d / name.replace("__", "/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    return setup


def recipe(text):
    return files(**{"recipe.lua": text})


CASES = [
    Case("error with a table", ["run", "recipe.lua"],
         r"^wick: error: recipe\.lua:2: error object is a table \(no __tostring",
         setup=recipe("local wick = require 'wick'\nerror({ code = 3 })\n")),
    Case("error with a table with __tostring", ["run", "recipe.lua"], r"^wick: error: disk quota at 98%$",
         setup=recipe("local wick = require 'wick'\n"
                      "error(setmetatable({}, { __tostring = function() return 'disk quota at 98%' end }))\n")),
    Case("error with a boolean", ["run", "recipe.lua"], r"^wick: error: recipe\.lua:1: error object is a boolean value",
         setup=recipe("error(false)\n")),
    Case("recipe is a directory", ["run", "recipes"], r"recipe recipes is a directory, expected a Lua file",
         setup=files(**{"recipes__a.lua": "print(1)\n"})),
    Case("pair before the recipe", ["run", "a=1", "args.lua"],
         r"'a=1' is not a recipe file: the recipe comes first.*wick run args\.lua a=1", rc=2,
         setup=files(**{"args.lua": "print(1)\n"})),
    Case("only pairs", ["run", "a=1", "b=2"], r"'a=1' is not a recipe file: the recipe comes first", rc=2),
    Case("plan: pair before the recipe", ["plan", "lr=1", "args.lua"], r"'lr=1' is not a recipe file", rc=2,
         setup=files(**{"args.lua": "print(1)\n"})),
    Case("launch: pair before the recipe", ["launch", "--nproc-per-node", "1", "lr=1", "args.lua"],
         r"'lr=1' is not a recipe file", rc=2, setup=files(**{"args.lua": "print(1)\n"})),
]
