"""Plugins: libraries on the plugin path that are not what they claim, that
crash while they load, that cannot be loaded, or that share a name. Listing
them never takes `wick plugins` down; using them is an error naming the file."""
import os
import shutil
from pathlib import Path

from harness import WICK, Case

BUILD = Path(WICK).resolve().parents[1]
BROKEN = Path(os.environ.get("WICK_TEST_PLUGIN_DIR", str(BUILD / "lib" / "wick" / "test-plugins")))
PLUGINS = BUILD / "lib" / "wick" / "plugins"

EXPORTS = r"; WICK_PLUGIN\(\.\.\.\) exports it as a pointer to the plugin's descriptor"


def on_path(*names, text=None):
    """Copies the built broken plugins `names` (test_<name>.so) into p/, and
    writes `text` (name -> bytes) there too."""
    def setup(d):
        (d / "p").mkdir()
        for n in names:
            shutil.copy(BROKEN / f"test_{n}.so", d / "p" / f"test_{n}.so")
        for n, data in (text or {}).items():
            (d / "p" / n).write_bytes(data)
        (d / "recipe.lua").write_text(
            "local wick = require 'wick'\n"
            "local m = wick.model(wick.args.model or 'mlp', { inputs = 2 })\n"
            "print('built ' .. m:item_name())\n")
    return setup


def twice(d):
    for sub in ("a", "b"):
        (d / sub).mkdir()
        shutil.copy(PLUGINS / "mlp.so", d / sub / "mlp.so")


PATH = {"WICK_PLUGIN_PATH": lambda d: str(d / "p")}

CASES = [
    # what `wick_plugin` points at is checked before it is read
    Case("wick_plugin is an int: listed", ["plugins"],
         r"test_int_alias\s+unusable: exports 'wick_plugin' as a 4-byte object, not a 8-byte pointer" + EXPORTS,
         setup=on_path("int_alias"), env=PATH, rc=0),
    Case("wick_plugin is an int: used", ["run", "recipe.lua", "model=test_int_alias"],
         r"recipe\.lua:2: plugin 'test_int_alias' \(.*/p/test_int_alias\.so\) exports 'wick_plugin' as a 4-byte object",
         setup=on_path("int_alias"), env=PATH),
    Case("wick_plugin is an int: other plugins still run", ["run", "recipe.lua"], r"^built samples$",
         setup=on_path("int_alias"), env=PATH, rc=0),
    Case("wick_plugin is a function: listed", ["plugins"],
         r"test_function_alias\s+unusable: exports 'wick_plugin' as a function" + EXPORTS,
         setup=on_path("function_alias"), env=PATH, rc=0),
    Case("wick_plugin is a function: used", ["run", "recipe.lua", "model=test_function_alias"],
         r"plugin 'test_function_alias' \(.*test_function_alias\.so\) exports 'wick_plugin' as a function",
         setup=on_path("function_alias"), env=PATH),
    Case("wick_plugin is a null pointer", ["describe", "test_null_alias"],
         r"plugin 'test_null_alias' \(.*test_null_alias\.so\) exports a 'wick_plugin' that points to nothing",
         setup=on_path("null_alias"), env=PATH),
    Case("wick_plugin points at a function", ["plugins"],
         r"test_code_alias\s+unusable: exports a 'wick_plugin' that points into code \(a function\?\)",
         setup=on_path("code_alias"), env=PATH, rc=0),
    # a library whose static initialisation aborts: loaded in a child process first
    Case("plugin aborts while loading: listed", ["plugins"],
         r"test_aborts\s+unusable: cannot be loaded: a test process that loaded it was killed by SIGABRT "
         r"\(its static initialisation crashes\); it was not loaded",
         setup=on_path("aborts"), env=PATH, rc=0),
    Case("plugin aborts while loading: other plugins still run", ["run", "recipe.lua"], r"^built samples$",
         setup=on_path("aborts"), env=PATH, rc=0),
    Case("plugin aborts while loading: named by path", ["run", "recipe.lua", "model=p/test_aborts.so"],
         r"recipe\.lua:2: plugin p/test_aborts\.so cannot be loaded: a test process that loaded it was killed by SIGABRT",
         setup=on_path("aborts"), env=PATH),
    Case("plugin aborts while loading: as JSON", ["plugins", "--json"],
         r'"error": "cannot be loaded: a test process that loaded it was killed by SIGABRT',
         setup=on_path("aborts"), env=PATH, rc=0),
    # dlopen's reason, not boost's error code
    Case("not a shared library: listed", ["plugins"],
         r"junk\s+unusable: cannot be loaded: (invalid ELF header|file too short)$",
         setup=on_path(text={"junk.so": b"this is not an ELF file at all, only text\n" * 4}), env=PATH, rc=0),
    Case("not a shared library: named by path", ["run", "recipe.lua", "model=p/junk.so"],
         r"recipe\.lua:2: plugin p/junk\.so cannot be loaded: (invalid ELF header|file too short)$",
         setup=on_path(text={"junk.so": b"this is not an ELF file at all, only text\n" * 4}), env=PATH),
    Case("empty .so file", ["run", "recipe.lua", "model=p/empty.so"],
         r"plugin p/empty\.so cannot be loaded: file too short$",
         setup=on_path(text={"empty.so": b""}), env=PATH),
    # a name given twice (here 3 times, with the built-in one): listed as such, as `run` refuses it
    Case("plugin name given twice: listed", ["plugins"],
         r"^\?\s+mlp\s+unusable: is given 3 times: .*/a/mlp\.so and .*/b/mlp\.so and .*/plugins/mlp\.so "
         r"\(remove all but one from the plugin path\)",
         setup=twice, env={"WICK_PLUGIN_PATH": lambda d: f"{d / 'a'}:{d / 'b'}"}, rc=0),
    Case("plugin name given twice: described", ["describe", "mlp"],
         r"plugin 'mlp' is given 3 times: .*/a/mlp\.so and .*/b/mlp\.so and .*/plugins/mlp\.so",
         setup=twice, env={"WICK_PLUGIN_PATH": lambda d: f"{d / 'a'}:{d / 'b'}"}),
]
