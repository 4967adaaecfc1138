"""scripts/setup's choices (WICK_LIBTORCH, WICK_CUDA): bad values are refused
with one line before anything is installed or built; a good LibTorch folder
is accepted. The installers and cmake are replaced by stand-ins that record a
call and fail, so no test here installs or builds anything."""
import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup"
STANDINS = ("dpkg-query", "apt-get", "sudo", "cmake", "python3")


def run_setup(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    marker = tmp_path / "called"
    for name in STANDINS:
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\necho {name} >> "{marker}"\nexit 1\n')
        p.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith("WICK_")}
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", WICK_DEPS=str(tmp_path / "deps"), WICK_BUILD=str(tmp_path / "build"))
    e.update(env)
    r = subprocess.run(["bash", str(SETUP)], env=e, capture_output=True, text=True, timeout=60)
    called = marker.read_text().split() if marker.exists() else []
    return r, called


def assert_refused(r, called, *parts):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    assert lines[0].startswith("setup: ")
    assert called == [], f"setup went on to {called}"


def test_a_libtorch_folder_that_does_not_exist(tmp_path):
    r, called = run_setup(tmp_path, WICK_LIBTORCH=str(tmp_path / "nowhere"))
    assert_refused(r, called, f"WICK_LIBTORCH={tmp_path / 'nowhere'} is not a folder", "expected an unpacked LibTorch")


def test_a_folder_without_torch_config(tmp_path):
    (tmp_path / "lt" / "lib").mkdir(parents=True)
    r, called = run_setup(tmp_path, WICK_LIBTORCH=str(tmp_path / "lt"))
    assert_refused(r, called, "holds no share/cmake/Torch/TorchConfig.cmake", "expected an unpacked LibTorch")


def test_a_cuda_choice_other_than_on_or_off(tmp_path):
    for value in ("yes", "on", "1"):
        r, called = run_setup(tmp_path, WICK_CUDA=value)
        assert_refused(r, called, f"WICK_CUDA={value}: expected ON or OFF")


def test_a_libtorch_folder_is_accepted(tmp_path):
    cfg = tmp_path / "lt" / "share" / "cmake" / "Torch"
    cfg.mkdir(parents=True)
    (cfg / "TorchConfig.cmake").write_text("")
    r, called = run_setup(tmp_path, WICK_LIBTORCH=str(tmp_path / "lt"), WICK_CUDA="OFF")
    # past the checks: it asks for the Debian packages (the stand-in fails there)
    assert r.returncode != 0
    assert "WICK_" not in r.stderr, r.stderr
    assert called and called[0] == "dpkg-query", called
