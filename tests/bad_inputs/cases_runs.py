"""Run folders: nothing a finished or running run wrote is lost."""
from harness import Case

RECIPE = """local wick = require 'wick'
local a = wick.args
wick.train { model = wick.model('mlp', { inputs = 4, hidden = { 8 }, outputs = 2 }),
  data = wick.data('synthetic', { size = 16, inputs = 4, classes = 2 }),
  optim = wick.optim('sgd', { lr = 0.1 }), max_steps = 2, micro_batch = 4, quiet = true, out = a.out,
  save_every = 1 }
"""


def finished_run(d):
    import subprocess
    from harness import WICK
    (d / "recipe.lua").write_text(RECIPE)
    subprocess.run([WICK, "run", "recipe.lua", "out=run"], cwd=d, check=True, capture_output=True)


CASES = [
    Case("reused run folder", ["run", "recipe.lua", "out=run"], r"run.*(resume|overwrite)", setup=finished_run),
    # wrote the HTML over the run's metrics, exit 0
    Case("report over the run's metrics", ["report", "run", "-o", "run/metrics.jsonl"],
         r"wick report -o: run/metrics\.jsonl is the run folder .*/run's own 'metrics\.jsonl', which would be lost",
         setup=finished_run),
]
