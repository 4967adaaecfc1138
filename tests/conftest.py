"""Shared fixtures: the wick executable and a runner for recipes."""
import os
import subprocess
from pathlib import Path

# Reproducible fp32 products in the references and in every wick the tests
# start (they inherit the environment): MKL otherwise picks its code path by
# CPU and memory alignment and its thread count by the machine's load, and the
# last bits it rounds differently are what the tests' 8-bit moments, fp16
# scaling and rank comparisons enlarge (on an AVX-512 machine under ctest's
# load, 1.9% of an 8-bit AdamW's weights left their reference, 0.1% alone).
# Set before anything calls into MKL, which reads them once.
os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

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
