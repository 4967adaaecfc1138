#!/usr/bin/env python3
"""Plugins depend only on the SDK and plugins/lib/.

Every #include in plugins/**/*.{cpp,hpp} is either <wick/...> (the SDK), a
quoted "lib/<folder>/<file>" naming a file of plugins/lib/, or a system or
third-party header that is neither a host folder nor a plugin folder; a
plugin's CMakeLists.txt links no host library. Before it checks the tree, the
checker runs itself on a small tree of wrong includes and fails unless it
reports each one.

Usage: check_includes.py SOURCE_DIR
"""
import re
import sys
import tempfile
from pathlib import Path

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)
HOST_TARGETS = re.compile(r"\b(wick_engine|wick_lua|wick_events|wick_media|wick::engine)\b(?!_)")


def violations(src: Path) -> list[str]:
    plugins, host = src / "plugins", src / "host"
    host_dirs = {p.name for p in host.iterdir() if p.is_dir()} if host.is_dir() else set()
    plugin_dirs = {p.name for p in plugins.iterdir() if p.is_dir()} | {"plugins", "host", "sdk"}
    out = []
    files = sorted(f for ext in ("cpp", "hpp", "h", "cc") for f in plugins.rglob(f"*.{ext}"))
    for f in files:
        rel = f.relative_to(src)
        for m in INCLUDE.finditer(f.read_text(errors="replace")):
            kind, name = m.group(1), m.group(2)
            first = name.split("/")[0]
            if kind == '"':
                if not name.startswith("lib/") or ".." in name.split("/") or not (plugins / name).is_file():
                    out.append(f'{rel}: #include "{name}": plugins include only <wick/...> and "lib/<folder>/<file>"')
            elif first != "wick" and (first in host_dirs or first in plugin_dirs or ".." in name.split("/")):
                out.append(f"{rel}: #include <{name}>: a host or plugin header")
    for f in sorted(plugins.rglob("CMakeLists.txt")):
        for m in HOST_TARGETS.finditer(f.read_text()):
            out.append(f"{f.relative_to(src)}: links the host library {m.group(1)}")
    return out


def self_test() -> None:
    bad = {
        "plugins/models/a/a.cpp": '#include "../b/b.hpp"\n',
        "plugins/models/b/b.cpp": '#include "models/a/a.hpp"\n',
        "plugins/data/c/c.cpp": '#include "media/decode.hpp"\n',
        "plugins/data/d/d.cpp": "#include <media/make_clips.hpp>\n",
        "plugins/optim/e/e.cpp": '#include "lib/nothing/here.hpp"\n',
        "plugins/lib/f/f.cpp": "#include <train/run.hpp>\n",
        "plugins/optim/g/CMakeLists.txt": "wick_add_plugin(g SOURCES g.cpp LIBRARIES wick_engine)\n",
    }
    good = {
        "plugins/lib/x/x.hpp": "#include <wick/model.hpp>\n#include <ATen/ATen.h>\n#include <vector>\n",
        "plugins/models/h/h.cpp": '#include <wick/model.hpp>\n#include "lib/x/x.hpp"\n',
        "plugins/models/h/CMakeLists.txt": "wick_add_plugin(h SOURCES h.cpp LIBRARIES wick_media_folder)\n",
        "host/media/make_clips.hpp": "",
        "host/train/run.hpp": "",
    }
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name, text in {**bad, **good}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        found = violations(root)
        for name in bad:
            if not any(v.startswith(name + ":") for v in found):
                sys.exit(f"check_includes self-test: {name} was not reported (got {found})")
        stray = [v for v in found if not any(v.startswith(n + ":") for n in bad)]
        if stray:
            sys.exit(f"check_includes self-test: good files reported: {stray}")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    self_test()
    found = violations(Path(sys.argv[1]))
    for v in found:
        print(v)
    if found:
        sys.exit(f"{len(found)} include(s) or link(s) outside the SDK and plugins/lib/")
    print("plugins include only the SDK and plugins/lib/")


if __name__ == "__main__":
    main()
