"""The manual builds: `mkdocs build --strict` over mkdocs.yml, so a broken link,
a missing anchor or a page left out of the navigation fails. scripts/setup
installs mkdocs into the venv; without it this prints a SKIP line (ctest then
reports the test skipped)."""
import os
import pathlib
import subprocess
import sys
import tempfile
import time

try:
    import mkdocs  # noqa: F401
    import material  # noqa: F401
except ImportError as e:
    print(f"SKIP docs: {e.name} is not installed (scripts/setup installs mkdocs and mkdocs-material)")
    sys.exit(0)

root = pathlib.Path(__file__).resolve().parents[2]
with tempfile.TemporaryDirectory() as site:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(root / "mkdocs.yml"),
                        "-d", site], capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    print(r.stdout + r.stderr)
    print(f"mkdocs build --strict: exit {r.returncode} in {time.monotonic() - start:.1f} s")
    sys.exit(r.returncode)
