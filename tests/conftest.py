"""Shared fixtures: the wick executable and a runner for recipes."""
import os
import subprocess
from pathlib import Path

import pytest

WICK = os.environ.get("WICK", str(Path(__file__).resolve().parents[1] / "build" / "bin" / "wick"))


@pytest.fixture
def run_wick():
    def run(*args, check=True):
        p = subprocess.run([WICK, *map(str, args)], capture_output=True, text=True, timeout=600)
        if check and p.returncode != 0:
            raise AssertionError(f"wick {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr}")
        return p

    return run


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (a rendezvous for ranks started by hand)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return str(port)
