"""MkDocs hook: pages show code from the tree instead of copies of it.

A line `<!-- include: PATH [LANG] -->` in a page becomes a fenced block with
the file PATH (relative to the repository root). For a C++ header the block
is the header's first \\code example, the one tests/install/check_prefix.sh
builds against the installed package, so the page shows the tested code.
"""
import pathlib
import re
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = re.compile(r"^<!-- include: (\S+)(?: (\w+))? -->$", re.M)


def first_code_example(text):
    lines, on = [], False
    for line in text.splitlines():
        if not on and line.rstrip().endswith("\\code"):
            on = True
        elif on and "\\endcode" in line:
            break
        elif on:
            lines.append(re.sub(r"^/// ?", "", line))
    return textwrap.dedent("\n".join(lines))


def expand(match):
    path, lang = match.group(1), match.group(2) or ""
    text = (ROOT / path).read_text()
    if path.endswith(".hpp"):
        text = first_code_example(text)
    return f"```{lang}\n{text.rstrip()}\n```"


def on_page_markdown(markdown, **kwargs):
    return INCLUDE.sub(expand, markdown)
