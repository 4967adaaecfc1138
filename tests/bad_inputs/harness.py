"""The bad-input corpus: each case makes its inputs in a fresh folder, runs one
wick command and checks what a user sees.

A case passes when
- the exit status is the expected one (1 for bad input, 2 for a usage error,
  0 for a run that must go on with a warning),
- a line of the output matches `message` (a regular expression naming the file
  or key and what was expected), and for a failure that line is the last line
  (after it only a usage hint for exit status 2) and starts with "wick",
- nothing looks like a crash: no C++ frames, no "terminate called", no signal,
  no Lua stack traceback,
- nothing on disk changed that should not: every file the case made is
  byte-for-byte the same afterwards, and no file appeared outside `may_write`
  (glob patterns relative to the case folder).

Inputs are generated here, never checked in as binaries. Cases live in the
cases_<area>.py modules of this folder, each with a list CASES.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
WICK = os.environ.get("WICK", str(REPO / "build" / "bin" / "wick"))
SOURCE = Path(os.environ.get("WICK_SOURCE", str(REPO)))

# Output that means a crash or an internal error reached the user.
CRASH_MARKS = (
    "frame #", "Exception raised from", "terminate called", "Segmentation fault",
    "core dumped", "stack traceback:", "C++ exception", "Aborted", "what():",
    "[json.exception", "AddressSanitizer",
)


@dataclass
class Case:
    name: str
    # The command after `wick`; a callable gets the case folder and returns it.
    argv: Sequence[str] | Callable[[Path], Sequence[str]]
    # A regular expression searched in each line of the output.
    message: str
    # Makes the input files in the case folder.
    setup: Callable[[Path], None] | None = None
    rc: int = 1
    env: dict = field(default_factory=dict)
    # Glob patterns (relative to the case folder) the command may create or change.
    may_write: Sequence[str] = ()
    stdin: str | None = None
    timeout: float = 120.0


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str
    problems: list


def snapshot(root: Path) -> dict:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            files[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def allowed(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(path, pat) or path.startswith(pat.rstrip("*").rstrip("/") + "/") and pat.endswith("**")
               for pat in patterns)


def run_case(case: Case, folder: Path) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    if case.setup:
        case.setup(folder)
    before = snapshot(folder)
    argv = case.argv(folder) if callable(case.argv) else case.argv
    env = dict(os.environ)
    env.update({k: (v(folder) if callable(v) else str(v)) for k, v in case.env.items()})
    env.setdefault("WICK_SOURCE", str(SOURCE))
    p = subprocess.Popen([WICK, *map(str, argv)], cwd=folder, env=env, text=True, errors="replace",
                         stdin=subprocess.PIPE if case.stdin is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    problems = []
    try:
        out, err = p.communicate(case.stdin, timeout=case.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        problems.append(f"hung: no exit within {case.timeout:.0f} s")
    rc = p.returncode
    if rc < 0:
        problems.append(f"killed by signal {signal.Signals(-rc).name}")
    elif rc != case.rc and not problems:
        problems.append(f"exit status {rc}, expected {case.rc}")
    text = out + err
    for mark in CRASH_MARKS:
        if mark in text:
            problems.append(f"crash-like output: {mark!r}")
    lines = [l for l in text.splitlines() if re.search(case.message, l)]
    if not lines:
        problems.append(f"no line matches {case.message!r}")
    if case.rc != 0:
        lines = [l for l in err.splitlines() if l.strip()]
        if case.rc == 2:  # a usage error may be followed by the usage
            lines = [l for l in lines if not l.startswith(("usage:", "Usage:", "Run '", " "))] or [""]
        last = lines[-1] if lines else ""
        if not re.search(case.message, last):
            problems.append(f"the last line of stderr is not the message: {last!r}")
        elif not last.startswith("wick"):
            problems.append(f"the message does not start with 'wick': {last!r}")
    after = snapshot(folder)
    for path, digest in before.items():
        if path not in after:
            if not allowed(path, case.may_write):
                problems.append(f"{path} was removed")
        elif after[path] != digest and not allowed(path, case.may_write):
            problems.append(f"{path} was changed")
    for path in after.keys() - before.keys():
        if not allowed(path, case.may_write):
            problems.append(f"{path} was created")
    return Outcome(rc, out, err, problems)


def all_cases() -> dict:
    """Every case by area: {area: [Case, ...]} from the cases_<area>.py modules."""
    import importlib.util

    areas = {}
    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        areas[path.stem.removeprefix("cases_")] = list(module.CASES)
    return areas
