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


TRAIN = """local wick = require 'wick'
local data = wick.data('synthetic', { size = 32, inputs = 8, classes = 2 })
local model = wick.model('mlp', { inputs = 8, hidden = { 8 }, outputs = 2 })
local lr = tonumber(wick.args.lr) or 0.1
wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = lr }), micro_batch = 8, quiet = true }
"""

READS_LATER = """local wick = require 'wick'
local data = wick.data('synthetic', { size = 32, inputs = 8, classes = 2 })
local model = wick.model('mlp', { inputs = 8, hidden = { 8 }, outputs = 2 })
wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 8, quiet = true }
print('lr ' .. tostring(wick.args.lr))
"""

NO_TRAIN = "local wick = require 'wick'\nprint(wick.args.a)\n"

ITERATES = """local wick = require 'wick'
local n = 0
for k, v in pairs(wick.args) do n = n + 1 end
print(n .. ' pairs')
"""

CASES = [
    # key=value pairs the recipe never uses: a warning, the run goes on (exit 0)
    Case("unused key named at wick.train's start", ["run", "recipe.lua", "epoch=3"],
         r"^wick: warning: wick\.train: command-line key epoch=3 is not used so far", rc=0, setup=recipe(TRAIN)),
    Case("unused keys naming some option named when the recipe ends", ["run", "recipe.lua", "hidden=4", "inputs=3",
                                                                      "max_steps=1"],
         r"^wick: warning: command-line keys hidden=4 inputs=3 never used", rc=0, setup=recipe(TRAIN)),
    Case("unused keys naming no option named at wick.train's start", ["run", "recipe.lua", "epoch=3", "lrr=0.5"],
         r"^wick: warning: wick\.train: command-line keys epoch=3 lrr=0\.5 are not used so far", rc=0,
         setup=recipe(TRAIN)),
    Case("unused key without wick.train", ["run", "recipe.lua", "a=1", "b=2"],
         r"^wick: warning: command-line key b=2 never used: no wick\.train option took it and the recipe never read it",
         rc=0, setup=recipe(NO_TRAIN)),
    Case("a key read after wick.train is not named, a typo beside it is", ["run", "recipe.lua", "lr=0.01", "bogus=1"],
         r"^wick: warning: wick\.train: command-line key bogus=1 is not used so far", rc=0,
         setup=recipe(READS_LATER)),
    Case("pairs() over wick.args uses every key", ["run", "recipe.lua", "a=1", "b=2"], r"^2 pairs$", rc=0,
         setup=recipe(ITERATES)),
    # numbers that are no setting
    Case("lr=inf read by the recipe", ["run", "recipe.lua", "lr=inf"],
         r"optim 'sgd': option 'lr': expected a finite number, got number inf", setup=recipe(TRAIN)),
    Case("lr=nan read by the recipe", ["run", "recipe.lua", "lr=nan"],
         r"optim 'sgd': option 'lr': expected a finite number", setup=recipe(TRAIN)),
    Case("lr=1e999 read by the recipe", ["run", "recipe.lua", "lr=1e999"],
         r"optim 'sgd': option 'lr': expected a finite number", setup=recipe(TRAIN)),
    Case("seed=inf", ["run", "recipe.lua", "seed=inf"], r"command line: seed=inf: expected integer >= 0",
         setup=recipe(TRAIN)),
    Case("seed=nan", ["run", "recipe.lua", "seed=nan"], r"command line: seed=nan: expected integer >= 0",
         setup=recipe(TRAIN)),
    Case("seed=1.5", ["run", "recipe.lua", "seed=1.5"], r"command line: seed=1\.5: expected integer >= 0",
         setup=recipe(TRAIN)),
    Case("seed=-1", ["run", "recipe.lua", "seed=-1"], r"command line: seed=-1: expected integer >= 0",
         setup=recipe(NO_TRAIN)),
    Case("wick.seed(1/0)", ["run", "recipe.lua"], r"recipe\.lua:2: wick\.seed: expected a whole number",
         setup=recipe("local wick = require 'wick'\nwick.seed(1/0)\n")),
    Case("clip_grad_norm = 1/0 in the recipe", ["run", "recipe.lua"],
         r"option 'clip_grad_norm': expected a finite number, got number inf",
         setup=recipe(TRAIN.replace("quiet = true", "quiet = true, clip_grad_norm = 1/0"))),

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
    Case("master_weights=true without a true precision", ["run", "recipe.lua", "master_weights=true"],
         r"recipe\.lua:5: wick\.train: option 'master_weights': only with precision = \"bf16-true\" or \"fp16-true\" \(fp32 weights are fp32 already\)",
         setup=recipe(TRAIN)),
    Case("master_weights=yes", ["run", "recipe.lua", "precision=bf16-true", "master_weights=yes"],
         r"command line: master_weights=yes: expected", setup=recipe(TRAIN)),
]
