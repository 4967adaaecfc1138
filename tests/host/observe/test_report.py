"""`wick report`: a self-contained HTML file rendered by headless Chromium.
The DOM after its script ran must hold every plot, each drawn from the
numbers in metrics.jsonl (point for point, on a linear scale), and the
screenshot must show them painted."""
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

CHROME = shutil.which("chromium-headless-shell") or shutil.which("chromium")

RECIPE = """
local wick = require "wick"
local data = wick.data("synthetic", { size = 120, inputs = 8, classes = 3, seed = 2 })
local eval = wick.data("synthetic", { size = 40, inputs = 8, classes = 3, seed = 3 })
wick.train {
  model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 }),
  data = data, eval_data = eval, eval_every = 10,
  optim = wick.optim("adamw", { lr = 1e-2 }), schedule = "cosine", warmup_steps = 3,
  micro_batch = 2, accumulate = 2, epochs = 1, out = "%s", quiet = true,
  -- a scale far too large: the first steps overflow and are skipped
  precision = "fp16-mixed", loss_scale = { init = 2^40, backoff = 2^-10, growth = 2, interval = 5 },
}
"""


def chrome(*args):
    if not CHROME:
        pytest.fail("headless Chromium is not installed (scripts/setup installs chromium-headless-shell)")
    p = subprocess.run([CHROME, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=10000",
                        *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p


class Dom(HTMLParser):
    """Elements with their attributes, and the text of each figure."""

    def __init__(self):
        super().__init__()
        self.elements = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))


def path_points(d):
    return [(float(a), float(b)) for a, b in re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d)]


def assert_linear(xs, vs, tol=0.02):
    """Screen coordinates are an affine map of the values (to 2 decimals)."""
    xs, vs = np.asarray(xs, float), np.asarray(vs, float)
    A = np.stack([vs, np.ones_like(vs)], axis=1)
    coef, *_ = np.linalg.lstsq(A, xs, rcond=None)
    assert np.abs(A @ coef - xs).max() < tol
    return coef


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from conftest import WICK
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "run"
    (tmp / "recipe.lua").write_text(RECIPE % out)
    subprocess.run([WICK, "run", tmp / "recipe.lua"], check=True, capture_output=True, timeout=300)
    subprocess.run([WICK, "report", out], check=True, capture_output=True, timeout=60)
    return out


def records(out):
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if not r.get("eval")], [r for r in recs if r.get("eval")]


def test_report_is_self_contained(run_dir):
    html = (run_dir / "report.html").read_text()
    # nothing fetched: no external scripts, styles, images or fonts
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and not re.search(r"url\(\s*['\"]?(https?:)?//", html)
    assert "<script src" not in html


def test_plots_are_drawn_from_the_metrics(run_dir):
    steps, evals = records(run_dir)
    skipped = [r["step"] for r in steps if r["skipped"]]
    assert 1 in skipped and len(skipped) >= 2  # the overflows the recipe provokes
    dom = Dom()
    dom.feed(chrome("--dump-dom", (run_dir / "report.html").as_uri()).stdout)
    body = [a for t, a in dom.elements if t == "body"][0]
    assert body.get("data-rendered") == "ok", body
    figures = [a["data-plot"] for t, a in dom.elements if t == "figure" and "data-plot" in a]
    assert figures == ["loss", "lr", "grad_norm", "loss_scale", "throughput", "memory", "memory_tensors",
                       "eval_accuracy"]
    paths = {a["data-name"]: a for t, a in dom.elements if t == "path" and "series" in a.get("class", "")}
    for name, field in [("train loss", "loss"), ("lr", "lr"), ("grad norm", "grad_norm"), ("loss scale", "loss_scale"),
                        ("resident", "mem_resident"), ("after the step", "mem_tensors")]:
        pts = path_points(paths[name]["d"])
        want = [(r["step"], r[field]) for r in steps]
        if name == "loss scale":  # drawn on a log scale
            want = [(s, np.log10(v)) for s, v in want]
        want = [(s, v) for s, v in want if v is not None]  # inf/nan (a skipped step's norm) is null in JSON
        assert len(pts) == len(want) == int(paths[name]["data-points"]), name
        assert_linear([p[0] for p in pts], [s for s, _ in want])  # x: the step
        coef = assert_linear([p[1] for p in pts], [v for _, v in want])  # y: the value
        if len(set(v for _, v in want)) > 1:
            assert coef[0] < 0, name  # larger values higher up
    # evaluation losses as points, skipped steps as markers at their steps
    groups = [a for t, a in dom.elements if t == "g" and a.get("data-name") == "eval loss"]
    assert int(groups[0]["data-points"]) == len(evals)
    markers = [int(a["data-step"]) for t, a in dom.elements if t == "line" and a.get("data-name") == "skipped step"]
    assert markers == skipped
    # the memory breakdown of run.json
    mem = json.loads((run_dir / "run.json").read_text())["memory"]
    parts = {a["data-part"]: int(a["data-bytes"]) for t, a in dom.elements if t == "div" and "data-part" in a}
    assert parts == {k: mem[k] for k in ("weights", "gradients", "optimizer", "data", "activations", "other") if mem[k] > 0}


def test_screenshot_shows_the_plots(run_dir, tmp_path):
    """Pixels of each line's colour: the drawn page against the same page whose
    data does not parse (no plot drawn; badges and the breakdown bar share
    some colours, so the difference is what the plots painted)."""
    from PIL import Image
    broken = tmp_path / "broken.html"
    broken.write_text((run_dir / "report.html").read_text().replace('id="wick-data">', 'id="wick-data">x'))

    def shot(page):
        png = tmp_path / "shot.png"
        chrome("--window-size=1300,5000", f"--screenshot={png}", page.as_uri())  # all of the page
        return np.asarray(Image.open(png).convert("RGB")).astype(int)

    good, bad = shot(run_dir / "report.html"), shot(broken)

    def painted(rgb, tol=20):
        n = lambda img: int((np.abs(img - np.array(rgb)).max(axis=2) <= tol).sum())
        return n(good) - n(bad)

    assert painted((0x3b, 0x6f, 0xd8)) > 300  # the loss line, resident memory
    assert painted((0x2e, 0x9d, 0x5b)) > 300  # the learning rate, tensors after the step
    assert painted((0x8a, 0x4f, 0xd0)) > 300  # the gradient norm
    assert painted((0xc9, 0x37, 0x2c)) > 50  # skipped-step markers, peaks
    assert painted((0xc9, 0x8a, 0x16)) > 100  # the loss scale


def test_report_of_a_run_cut_short(run_dir, tmp_path, run_wick):
    """A run killed mid-write: the last line is half a record. The report
    shows the complete ones and says so."""
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    text = (cut / "metrics.jsonl").read_text()
    (cut / "metrics.jsonl").write_text(text[: len(text) - 40])
    run_wick("report", cut, "-o", tmp_path / "cut.html")
    html = (tmp_path / "cut.html").read_text()
    assert "1 unreadable record in metrics.jsonl skipped" in html and "cut short" in html
    dom = Dom()
    dom.feed(chrome("--dump-dom", (tmp_path / "cut.html").as_uri()).stdout)
    assert [a for t, a in dom.elements if t == "body"][0].get("data-rendered") == "ok"


def test_report_errors(run_wick, tmp_path):
    p = run_wick("report", tmp_path / "missing", check=False)
    assert p.returncode == 1 and "missing: no such folder" in p.stderr
    (tmp_path / "empty").mkdir()
    p = run_wick("report", tmp_path / "empty", check=False)
    assert p.returncode == 1 and "has no metrics.jsonl" in p.stderr
    p = run_wick("report", check=False)
    assert p.returncode == 2 and "needs a run folder" in p.stderr
