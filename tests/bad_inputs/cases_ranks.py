"""Ranks: a bad WICK_DIST_TIMEOUT, a rank whose partners never come, a rank
that gives up while another is stalled in a child process. Each ends with a
clear error within the case's timeout; none waits silently."""
import socket

from harness import Case

RECIPE = """local wick = require 'wick'
wick.train { model = wick.model('mlp', { inputs = 4, hidden = { 8 }, outputs = 2 }),
  data = wick.data('synthetic', { size = 16, inputs = 4, classes = 2 }),
  optim = wick.optim('sgd', { lr = 0.1 }), max_steps = 2, micro_batch = 4, quiet = true }
"""

# rank 1 gives up at once; rank 0 sits in a child process that ignores SIGTERM
STALL = """local rank = tonumber(os.getenv('RANK'))
if rank == 1 then error('rank 1 gives up') end
os.execute("trap '' TERM; sleep 1000")
"""


def recipe(text):
    def setup(d):
        (d / "recipe.lua").write_text(text)
    return setup


def free_port(_d):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return str(port)


EXPECTED = r"expected a number of seconds above 0 and at most 604800 \(7 days\); unset, it is 300$"


def lone(rank, world=2):
    return {"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port,
            "WICK_DIST_TIMEOUT": "3"}


CASES = [
    *[Case(f"WICK_DIST_BACKEND={v}", ["run", "recipe.lua"],
           rf"WICK_DIST_BACKEND={v}: expected nccl or gloo \(unset: nccl for CUDA, gloo for the CPU\)$",
           setup=recipe(RECIPE), env={"WICK_DIST_BACKEND": v})
      for v in ("mpi", "NCCL", "gloo ")],
    Case("WICK_DIST_BACKEND=nccl on the CPU", ["run", "recipe.lua"],
         r"WICK_DIST_BACKEND=nccl with device 'cpu': NCCL moves CUDA tensors only",
         setup=recipe(RECIPE), env={"WICK_DIST_BACKEND": "nccl"}),
    *[Case(f"WICK_DIST_TIMEOUT={v}", ["run", "recipe.lua"], rf"environment variable WICK_DIST_TIMEOUT={v}: " + EXPECTED,
           setup=recipe(RECIPE), env={"WICK_DIST_TIMEOUT": v})
      for v in ("abc", "0", "-5", "1e30", "inf", "nan", "30s", "604801")],
    Case("WICK_DIST_TIMEOUT refused by the launcher before any rank starts",
         ["launch", "--nproc-per-node", "2", "recipe.lua"], r"^wick: error: environment variable WICK_DIST_TIMEOUT=-5: ",
         setup=recipe(RECIPE), env={"WICK_DIST_TIMEOUT": "-5"}),
    Case("rank 0 alone: whom it waits for, then gives up", ["run", "recipe.lua"],
         r"rank 0 of 2: the rendezvous at 127\.0\.0\.1:\d+ \(torchrun-style variables\) timed out after 3 s: "
         r"rank 1 never arrived", setup=recipe(RECIPE), env=lone(0), timeout=30),
    Case("rank 0 alone of 4", ["run", "recipe.lua"], r"timed out after 3 s: ranks 1-3 never arrived",
         setup=recipe(RECIPE), env=lone(0, 4), timeout=30),
    Case("rank 1 without rank 0", ["run", "recipe.lua"],
         r"rank 1 of 2: reaching the rendezvous at 127\.0\.0\.1:\d+ .* rank 0 hosts it: did rank 0 start",
         setup=recipe(RECIPE), env=lone(1), timeout=30),
    # retried until the timeout and ended as "Interrupted system call" before
    *[Case(f"rendezvous address that does not resolve (rank {r})", ["run", "recipe.lua"],
           rf"rank {r} of 2: the rendezvous address 'no-such-host\.invalid' \(torchrun-style variables\) does not "
           r"resolve: .*; expected a host name or IP address of rank 0's machine",
           setup=recipe(RECIPE), env={**lone(r), "MASTER_ADDR": "no-such-host.invalid"}, timeout=30) for r in (0, 1)],
    # the launcher stops the stalled rank's process group, its `sleep` with it (the
    # no-survivor check is tests/host/distributed/test_ranks.py)
    Case("a rank gives up while another is stalled in a child process", ["launch", "--nproc-per-node", "2", "recipe.lua"],
         r"^wick launch: rank 1 exited with code 1; the other ranks were stopped$", setup=recipe(STALL), timeout=40),
]
