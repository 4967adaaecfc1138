"""Measuring the margins of the suite's learning and tolerance bounds (not a
test; loaded with `-p`): MSEED=k shifts every wick seed a test's recipes name
(wick.seed(n) -> n + 100 k, `seed = n` -> n + 100 k, a wick.seed(100 k) added
where a recipe has none) and torch.manual_seed (n -> n + 1000 k); each wick
run's stdout, exit code and stderr go to MLOG as JSON lines, and the worst
|difference| / allowed of each torch.testing.assert_close and each module's
assert_same_weights go to TLOG. k = 0 changes nothing but logs. The manual's
"Tests on other CPUs" figures were measured so, each under OMP_NUM_THREADS=1
with and without ATEN_CPU_CAPABILITY=avx2 (two checks that compute their error
inline, test_precision_vs_pytorch's and test_shard's close(), were logged by a
call to _tlog added to a copy of the test):

  cd tests && MSEED=2 PYTHONPATH=tools python -m pytest -q -p no:cacheprovider \\
      -p margins_plugin reference/test_decoder_families.py -k qlora_trains
"""
import os, re, subprocess, pathlib, json
S = int(os.environ.get("MSEED", "0"))
LOG = os.environ.get("MLOG", "margins_runs.jsonl")

def _sub(text):
    if S == 0 or 'require "wick"' not in text:
        return text
    text = re.sub(r"wick\.seed\((\d+)\)", lambda m: f"wick.seed({int(m.group(1)) + 100 * S})", text)
    text = re.sub(r"\bseed = (\d+)", lambda m: f"seed = {int(m.group(1)) + 100 * S}", text)
    if "wick.seed(" not in text:
        text = text.replace('local wick = require "wick"', f'local wick = require "wick"\nwick.seed({100 * S})', 1)
    return text

_wt = pathlib.Path.write_text
def write_text(self, data, *a, **k):
    return _wt(self, _sub(data) if isinstance(data, str) else data, *a, **k)
pathlib.Path.write_text = write_text

try:
    import torch
    _ms = torch.manual_seed
    torch.manual_seed = lambda s: _ms(int(s) + 1000 * S)
except ImportError:
    pass

_run = subprocess.run
def run(*a, **k):
    p = _run(*a, **k)
    try:
        argv = a[0] if a else k.get("args")
        if isinstance(p.stdout, str) and "wick" in str(argv[0]):
            with open(LOG, "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "seed": S,
                                    "cap": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
                                    "argv": " ".join(map(str, argv[1:]))[-200:], "out": p.stdout[-2000:], "rc": p.returncode, "err": (p.stderr or "")[-1500:]}) + "\n")
    except Exception:
        pass
    return p
subprocess.run = run

# tolerance margins: the worst |diff| / allowed of each comparison, logged
TLOG = os.environ.get("TLOG", "margins_tolerances.jsonl")
def _tlog(kind, ratio, extra=""):
    with open(TLOG, "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "cap": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
                            "seed": S, "kind": kind, "ratio": ratio, "extra": extra}) + "\n")
try:
    import torch
    _ac = torch.testing.assert_close
    def assert_close(actual, expected, *a, rtol=None, atol=None, **k):
        try:
            if rtol is not None and atol is not None and isinstance(actual, torch.Tensor) and (rtol > 0 or atol > 0):
                x, y = actual.double(), expected.double()
                allowed = atol + rtol * y.abs()
                _tlog("assert_close", ((x - y).abs() / allowed).max().item(), f"rtol={rtol} atol={atol} {k.get('msg', '')}")
        except Exception:
            pass
        return _ac(actual, expected, *a, rtol=rtol, atol=atol, **k)
    torch.testing.assert_close = assert_close
except ImportError:
    pass

def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for it in items:
        m = it.module
        if m in seen or not hasattr(m, "assert_same_weights"):
            continue
        seen.add(m)
        orig = m.assert_same_weights
        def wrapped(a, b, rtol=1e-5, _o=orig):
            from safetensors.torch import load_file
            try:
                wa, wb = load_file(str(a)), load_file(str(b))
                worst = max(((wa[k] - wb[k]).abs().max() / wb[k].abs().max()).item() for k in wb)
                if rtol > 1e-20:
                    _tlog("same_weights", worst / rtol, f"rtol={rtol} rel={worst:.3g}")
            except Exception:
                pass
            return _o(a, b, rtol=rtol)
        m.assert_same_weights = wrapped
