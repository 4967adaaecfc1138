"""Command-line keys a recipe never uses: a key read at any time (before,
during or after wick.train) is used; each key that is not is named in exactly
one warning: before the run starts when no option of wick.train or of a
plugin has its name (a likely typo), else when the recipe ends."""
import os
import subprocess

from conftest import WICK

# The recipe notes on stderr where it is, so that the warnings' place in the
# run shows: before training, during it (on_step), after it.
RECIPE = """local wick = require 'wick'
io.stderr:write('mark: before train\\n')
local data = wick.data('synthetic', { size = 32, inputs = 8, classes = 2 })
local model = wick.model('mlp', { inputs = 8, hidden = { 8 }, outputs = 2 })
for _ = 1, RUNS do
  wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 8, quiet = true,
    max_steps = 2, on_step = function() io.stderr:write('mark: step\\n') end }
end
io.stderr:write('mark: after train\\n')
READ_LATER
"""


def run(tmp_path, *pairs, runs=1, read_later=""):
    recipe = tmp_path / "recipe.lua"
    recipe.write_text(RECIPE.replace("RUNS", str(runs)).replace("READ_LATER", read_later))
    p = subprocess.run([WICK, "run", recipe, *pairs], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.startswith("mark: ") or l.startswith("wick: warning")]
    return lines, p.stdout


def warnings(lines):
    return [l for l in lines if l.startswith("wick: warning")]


def test_a_key_read_after_wick_train_is_never_warned_about(tmp_path):
    # lr (an option of sgd) for a second stage, read once the first has run
    lines, out = run(tmp_path, "lr=0.01", runs=2, read_later="print('lr ' .. tostring(wick.args.lr))")
    assert warnings(lines) == [], lines
    assert "lr 0.01" in out


def test_a_key_never_read_is_named_once_when_the_recipe_ends(tmp_path):
    # lr names an option (sgd's), so the recipe might still read it: no word
    # before the run, one warning after its end, over two wick.train calls
    lines, _ = run(tmp_path, "lr=0.5", runs=2)
    ws = warnings(lines)
    assert len(ws) == 1, lines
    assert "lr=0.5 never used" in ws[0]
    assert lines.index(ws[0]) > lines.index("mark: after train")


def test_a_typo_is_named_once_before_training(tmp_path):
    lines, _ = run(tmp_path, "epoch=3", runs=2)
    ws = warnings(lines)
    assert len(ws) == 1, lines
    assert "wick.train: command-line key epoch=3 is not used so far" in ws[0]
    at = lines.index(ws[0])
    assert lines.index("mark: before train") < at < lines.index("mark: step")


def test_a_typo_read_later_is_named_before_training_and_not_again(tmp_path):
    # before the run nothing can tell a late read from a typo; the one warning
    # says "so far", and the end has nothing left to name
    lines, out = run(tmp_path, "bogus=1", read_later="print('bogus ' .. tostring(wick.args.bogus))")
    ws = warnings(lines)
    assert len(ws) == 1 and "not used so far" in ws[0], lines
    assert "bogus 1" in out


def test_keys_taken_as_options_or_iterated_are_used(tmp_path):
    lines, _ = run(tmp_path, "max_steps=1", "a=1", "b=2",
                   read_later="local n = 0 for _ in pairs(wick.args) do n = n + 1 end print(n .. ' pairs')")
    # a and b name no option: named before the run, since pairs() comes after it
    ws = warnings(lines)
    assert len(ws) == 1 and "keys a=1 b=2 are not used so far" in ws[0], lines
    lines, out = run(tmp_path, "max_steps=1", "hidden=4",
                     read_later="local n = 0 for _ in pairs(wick.args) do n = n + 1 end print(n .. ' pairs')")
    assert warnings(lines) == [], lines
    assert "2 pairs" in out


def test_an_option_of_a_plugin_named_by_path_is_no_typo(tmp_path):
    # `coupled` is an option of the test plugin alone, loaded here by its path
    # (not on the search path): read after the run, it is never warned about
    plugin = os.path.join(os.environ.get("WICK_TEST_PLUGIN_DIR", os.path.join(os.path.dirname(WICK), "..", "lib", "wick",
                                                                              "test-plugins")),
                          "working", "test_window_coupled.so")
    recipe = tmp_path / "recipe.lua"
    recipe.write_text(f"""local wick = require 'wick'
local data = wick.data('synthetic', {{ size = 16, inputs = 4, classes = 2 }})
local model = wick.model('{plugin}', {{ inputs = 4 }})
wick.train {{ model = model, data = data, optim = wick.optim('sgd', {{ lr = 0.1 }}), micro_batch = 8, max_steps = 1,
  quiet = true }}
print('coupled ' .. tostring(wick.args.coupled))
""")
    p = subprocess.run([WICK, "run", recipe, "coupled=false"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr, p.stderr
    assert "coupled false" in p.stdout
