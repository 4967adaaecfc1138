"""`wick runs` and `wick report` over a run folder whose metrics.jsonl holds
records that cannot be read: each is skipped and named (file and line), the
rest is shown."""
import json

from harness import Case


def record(n, **extra):
    step = n
    rec = {"step": step, "loss": 1.0 / n, "lr": 0.1, "grad_norm": 0.5, "items": 8, "epoch": 0,
           "time": 0.1 * n, "skipped": False, "mem_peak_resident": 1 << 20}
    rec.update(extra)
    return json.dumps(rec)


def run_folder(*bad, steps=64, status="finished"):
    """A run of `steps` records; `bad` maps a line number (from 1) to the text put there instead."""
    bad = dict(bad)

    def setup(d):
        run = d / "runs" / "r"
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"status": status, "total_steps": steps, "recipe": "recipe.lua",
                                                  "started": 1700000000, "seconds": 12.0}) + "\n")
        lines = [bad.get(i + 1, record(i + 1)) for i in range(steps)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return setup


def cut_last_line(d):
    run_folder(steps=8)(d)
    p = d / "runs" / "r" / "metrics.jsonl"
    p.write_text(p.read_text() + '{"step": 9, "lo')


REPORT = ["runs/r/report.html"]

CASES = [
    Case("runs: a line that is not JSON", ["runs"], r"^runs/r\s+recipe\.lua\s+64/64\s.*finished$", rc=0,
         setup=run_folder((3, "{not json"))),
    Case("runs: the note names the bad line", ["runs"],
         r"^wick: warning: runs/r: 1 unreadable record in metrics\.jsonl skipped \(line 3: not JSON\)", rc=0,
         setup=run_folder((3, "{not json"))),
    Case("runs: a record of wrong types", ["runs"],
         r"^wick: warning: runs/r: 1 unreadable record .*line 5: 'loss' is a string, expected a number", rc=0,
         setup=run_folder((5, record(5, loss="nan")))),
    Case("runs: a step that is a string", ["runs"], r"line 1: 'step' is a string, expected a whole number", rc=0,
         setup=run_folder((1, record(1, step="1")))),
    Case("runs: a bad last record shows the progress before it", ["runs"], r"^runs/r\s+recipe\.lua\s+63/64\s", rc=0,
         setup=run_folder((64, "[1, 2]"))),
    Case("runs --json counts bad records", ["runs", "--json"], r'"bad_records":\s*2', rc=0,
         setup=run_folder((2, "null"), (9, record(9, eval="yes")))),
    Case("runs: a last line cut short by a kill", ["runs"], r"line 9: cut short", rc=0, setup=cut_last_line),
    Case("report: a record of wrong types", ["report", "runs/r"],
         r"^wick: warning: runs/r/metrics\.jsonl:4: record skipped: 'step' is a string", rc=0,
         setup=run_folder((4, record(4, step="4"))), may_write=REPORT),
    Case("report: a line that is not JSON", ["report", "runs/r"],
         r"^wick: warning: runs/r/metrics\.jsonl:2: record skipped: not JSON", rc=0,
         setup=run_folder((2, "}")), may_write=REPORT),
    Case("report: an evaluation without a loss", ["report", "runs/r"],
         r"^wick: warning: runs/r/metrics\.jsonl:7: record skipped: an evaluation record without a number 'loss'",
         rc=0, setup=run_folder((7, json.dumps({"step": 6, "eval": True, "accuracy": 0.5}))), may_write=REPORT),
    Case("report: no readable record", ["report", "runs/r"], r"runs/r/metrics\.jsonl holds no step yet",
         setup=run_folder((1, "x"), (2, "y"), steps=2)),
]
