"""The progress display: on a terminal one line redrawn in place, never wider
than the terminal; in a log a plain line every log_every steps; with several
ranks only rank 0 draws, and other ranks' lines never land inside its line."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios

from conftest import WICK

RECIPE = """
local wick = require "wick"
wick.train {
  model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 }),
  data = wick.data("synthetic", { size = 160, inputs = 8, classes = 3, seed = 2 }),
  optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 4, accumulate = 2, log_every = 5,
}
if wick.rank == 1 then io.stderr:write("a line from rank 1\\n") end
"""

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def in_terminal(args, cols):
    """Runs wick with stderr (and stdout) on a pseudo-terminal cols wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # keep "\n" as written
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    p = subprocess.Popen([WICK, *map(str, args)], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 120)
        if not r:
            p.kill()
            raise AssertionError("no output for 120 s")
        try:
            b = os.read(master, 65536)
        except OSError:  # the other side closed
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    assert p.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_terminal_line_is_redrawn_and_fits(tmp_path):
    recipe = tmp_path / "r.lua"
    recipe.write_text(RECIPE)
    for cols in (200, 72):
        out = in_terminal(["run", recipe], cols)
        draws = out.split("\r\x1b[K")[1:]
        steps = [d for d in draws if d.startswith("step ")]
        assert len(steps) >= 20  # every step redraws
        assert [int(re.match(r"step (\d+)/20", d).group(1)) for d in steps[:20]] == list(range(1, 21))
        for d in steps:
            line = d.split("\n")[0]
            assert len(line) < cols, (cols, line)  # never wraps
            assert "\r" not in line
        assert steps[-1].startswith("step 20/20") and steps[-1].count("\n") >= 1  # the last stays
        if cols == 200:
            assert all(k in steps[-1] for k in ("samples/s", "took", "loss", "lr", "mem"))
            assert "ETA" in steps[5]
        else:
            assert "loss" in steps[5]  # the first fields survive narrowing


def test_log_gets_plain_lines(tmp_path, run_wick):
    recipe = tmp_path / "r.lua"
    recipe.write_text(RECIPE)
    err = run_wick("run", recipe).stderr
    assert "\r" not in err and "\x1b" not in err
    lines = [l for l in err.splitlines() if l.startswith("step ")]
    assert [int(re.match(r"step (\d+)/20", l).group(1)) for l in lines] == [1, 5, 10, 15, 20]
    assert all(" | ETA " in l for l in lines[:-1])


def test_ranks_do_not_interleave(tmp_path):
    recipe = tmp_path / "r.lua"
    recipe.write_text(RECIPE)
    out = in_terminal(["launch", "--nproc-per-node", "2", recipe], 160)
    # what a terminal shows: each "\r\x1b[K" starts the line over
    shown = []
    for line in out.split("\n"):
        shown.append(line.split("\r\x1b[K")[-1])
    assert "[rank 1] a line from rank 1" in shown
    progress = [l for l in shown if "step " in l]
    assert progress and all(l.startswith("step ") and l.count("step ") == 1 for l in progress)
    assert not any("[rank 1]" in l and "step" in l for l in shown)
    # a log: plain lines only
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", recipe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0
    assert "\x1b" not in p.stderr
    steps = [l for l in p.stderr.splitlines() if "step " in l]
    # two ranks share the 160 samples: 10 steps
    assert [int(re.search(r"step (\d+)/10", l).group(1)) for l in steps] == [1, 5, 10]
    assert all(l.startswith("step ") for l in steps)
