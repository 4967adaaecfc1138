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


# profile's forms: true or {first, last}, steps within the run, and a run folder for the trace
def profiled(setting, out="out = 'run', "):
    def setup(d):
        (d / "recipe.lua").write_text(
            "local wick = require 'wick'\n"
            "wick.train { model = wick.model('mlp', { inputs = 4, hidden = { 8 }, outputs = 2 }),\n"
            "  data = wick.data('synthetic', { size = 16, inputs = 4, classes = 2 }),\n"
            f"  optim = wick.optim('sgd', {{ lr = 0.1 }}), max_steps = 3, micro_batch = 4, quiet = true, {out}{setting} }}\n")
    return setup


def profile_case(name, setting, message, out="out = 'run', "):
    return Case(f"profile {name}", ["run", "recipe.lua"], message, setup=profiled(setting, out))


# wick.profile's arguments: a function, then {trace = file, steps = whole number >= 1}
def wick_profile_case(name, call, message):
    def setup(d):
        (d / "recipe.lua").write_text("local wick = require 'wick'\n" + call + "\n")
    return Case(f"wick.profile {name}", ["run", "recipe.lua"], r"recipe\.lua:2: wick\.profile: " + message, setup=setup)


CASES = [
    wick_profile_case("of a number", "wick.profile(42)", r"expected a function to run under the profiler, got number"),
    wick_profile_case("options not a table", "wick.profile(function() end, 'trace.json')",
                      r"expected a table of options \(trace, steps\) after the function, got string"),
    wick_profile_case("unknown option", "wick.profile(function() end, { out = 'x' })",
                      r"unknown option 'out', expected trace \(a file for the trace\) or steps"),
    wick_profile_case("trace a number", "wick.profile(function() end, { trace = 5 })",
                      r"trace is 5, expected the path of a file to write the trace to"),
    wick_profile_case("empty trace", "wick.profile(function() end, { trace = '' })",
                      r"trace is , expected the path of a file to write the trace to"),
    wick_profile_case("zero steps", "wick.profile(function() end, { steps = 0 })",
                      r"steps is 0, expected a whole number >= 1"),
    wick_profile_case("a fraction of steps", "wick.profile(function() end, { steps = 1.5 })",
                      r"steps is 1\.5, expected a whole number >= 1"),
    profile_case("without out", "profile = true",
                 r"recipe\.lua:2: .*option 'profile' needs 'out', the run folder to write the trace \(profile\.json\) in",
                 out=""),
    profile_case("from step 0", "profile = { 0, 2 }",
                 r"recipe\.lua:2: .*option 'profile': expected true or \{first, last\}, the optimizer steps to record "
                 r"\(1 <= first <= last\), got \{0, 2\}"),
    profile_case("last before first", "profile = { 3, 2 }", r"option 'profile': expected true or \{first, last\}.*got \{3, 2\}"),
    profile_case("one step number", "profile = 2",
                 r"option 'profile': expected true or \{first, last\}.*got 2 \(one step: \{2, 2\}\)"),
    profile_case("three step numbers", "profile = { 1, 2, 3 }",
                 r"option 'profile': expected true or \{first, last\}.*got \{1, 2, 3\}"),
    profile_case("a string", "profile = 'yes'", r"recipe\.lua:2: .*option 'profile'.*(boolean|integer)"),
    profile_case("past the run's last step", "profile = { 5, 6 }",
                 r"recipe\.lua:2: .*option 'profile': step 5 is past the run's last step \(3\); give steps within 1 to 3"),
    Case("reused run folder", ["run", "recipe.lua", "out=run"], r"run.*(resume|overwrite)", setup=finished_run),
    # wrote the HTML over the run's metrics, exit 0
    Case("report over the run's metrics", ["report", "run", "-o", "run/metrics.jsonl"],
         r"wick report -o: run/metrics\.jsonl is the run folder .*/run's own 'metrics\.jsonl', which would be lost",
         setup=finished_run),
]
