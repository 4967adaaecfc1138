"""wick's Jinja engine against jinja2 as transformers configures it, one
language feature a template: whitespace control (trim_blocks, lstrip_blocks,
`-` and `+`), literals and escapes, operators, Undefined, loops and their
`loop`, scoping and namespaces, macros, slicing, filters, tests and the Python
methods of str, dict and list. Where jinja2 raises, wick raises with the same
message (raise_exception's verbatim; a syntax error's after "line N: ")."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

cu = pytest.importorskip("transformers.utils.chat_template_utils")
jinja2 = pytest.importorskip("jinja2")

BUILD = Path(os.environ.get("WICK", Path(__file__).resolve().parents[2] / "build" / "bin" / "wick")).parent
RENDER = os.environ.get("WICK_RENDER_TEMPLATE", str(BUILD / "wick_render_template"))

CTX = {
    "messages": [{"role": "system", "content": " sys "}, {"role": "user", "content": "Hi there, Ünïcödé ✓"},
                 {"role": "assistant", "content": "Hello!", "tool_calls": None}],
    "d": {"b": 2, "a": 1, "items": "shadowed", "nested": {"x": [1, 2, {"y": "z"}]}},
    "xs": [3, 1, 2], "s": "  Hello World  ", "n": 7, "f": 2.5, "t": True, "no": None, "empty": [], "u": "naïve café",
    "words": ["a", "b", "c"], "people": [{"name": "ann", "age": 30, "admin": True}, {"name": "bob", "age": 25},
                                         {"name": "cy", "age": 35, "admin": False}],
}

TEMPLATES = [
    # whitespace control
    "a\n  {% if t %}\n  yes\n  {% endif %}\nb",
    "a  {%- if t -%}  yes  {%- endif -%}  b",
    "a\n  {%+ if t %}x{% endif +%}\nb",
    "{% for x in xs %}\n  {{ x }}\n{% endfor %}\n",
    "  {# comment #}\nx\n{#- c -#}  y",
    "{{ 'a' }}  \n  {{- 'b' -}}  \n  c",
    "line\n    {% set z = 1 %}\n{{ z }}\n\n",
    "x {% if t %}y{% endif %}\nz",
    "\t{% if t %}\ttab{% endif %}",
    "{% raw %}{{ not rendered }}{% endraw %}",
    # literals
    "{{ 'it\\'s' }} {{ \"q\\\"\" }} {{ 'a\\nb\\tc\\\\' }} {{ '\\u00e9\\x41' }}",
    "{{ 1 }} {{ -3 }} {{ 1.5 }} {{ 1e3 }} {{ 10/4 }} {{ 10//4 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }} {{ 7 % -3 }}",
    "{{ 0.1 + 0.2 }} {{ 1/3 }} {{ 1e20 * 10 }} {{ 1e-7 }} {{ 100.0 }} {{ 3 * 1.0 }} {{ 2.5e-5 }}",
    "{{ true }} {{ True }} {{ none }} {{ None }} {{ [1, 'a', none, true] }} {{ {'k': 'v', 'n': 1} }} {{ (1, 2) }} {{ (1,) }}",
    "{{ \"it's\" }} {{ [\"it's\", 'say \"x\"', 'both \\' \"'] }}",
    "{{ 'a' 'b' }} {{ 'x' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }}",
    # operators and comparisons
    "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}",
    "{{ 'el' in 'hello' }} {{ 2 in xs }} {{ 'a' in d }} {{ 'z' not in d }} {{ not t }} {{ t and 'yes' }} {{ no or 'dflt' }}",
    "{{ 'yes' if t else 'no' }} {{ 'yes' if no else 'no' }} [{{ 'x' if no }}]",
    "{{ messages[0].role }} {{ messages[-1]['content'] }} {{ d.nested.x[2].y }} {{ d['items'] }} {{ d.b }}",
    # undefined
    "[{{ missing }}] {{ missing is defined }} {{ missing is undefined }} {{ missing | default('dflt') }} {{ missing|length }}",
    "{{ d.nope }}|{{ d.nope is defined }}|{{ messages[9] is defined }}|{{ '' | default('e', true) }}",
    "{% for x in missing %}{{ x }}{% else %}none{% endfor %}",
    "{{ missing.attr }}",
    "{{ d.nope.attr }}",
    "{{ missing + 1 }}",
    "{{ missing ~ 'x' }}",
    "{{ no.attr }}",
    # loops
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} {{ loop.first }} {{ loop.last }} {{ loop.revindex }};{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}",
    "{% for k in d %}{{ k }} {% endfor %}",
    "{% for x in xs if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}",
    "{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in xs %}{{ loop.previtem }}-{{ loop.nextitem }} {{ loop.cycle('odd', 'even') }};{% endfor %}",
    "{% for c in 'héllo' %}{{ c }}.{% endfor %}",
    "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}",
    "{% for x in empty %}x{% else %}empty{% endfor %}",
    # scoping
    "{% set x = 1 %}{% for i in xs %}{% set x = i %}{% endfor %}{{ x }}",
    "{% set ns = namespace(x=1, items=[]) %}{% for i in xs %}{% set ns.x = ns.x + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.x }} {{ ns.items }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}",
    "{% set block %}inner {{ n }}{% endset %}[{{ block }}]",
    "{% set x = 'outer' %}{% if t %}{% set x = 'if' %}{% endif %}{{ x }}",
    "{% for i in xs %}{% set y = i %}{{ y }}{% endfor %}{{ y }}",
    "{% set d2 = dict(a=1, b='x') %}{{ d2 }} {{ d2 | tojson }}",
    "{% for i in [1, 2] %}{% if i == 2 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}",
    "{% set y = 0 %}{% for i in [1, 2] %}{{ y }}{% set y = i %}{{ y }}{% endfor %}{{ y }}",
    "{% for i in [1, 2] %}{% for j in [3] %}{% set z = i %}{% endfor %}{{ z }}{% endfor %}",
    "{% set content %}\n  a\n  {% if true %}\n  b\n  {% endif %}\n{% endset %}[{{ content }}]",
    "{% filter upper %}hello {{ 'x' }}{% endfilter %}{{ range(3) | list }} {{ range(1, 7, 2) | list }}",
    # macros
    "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('ann') }} {{ greet('bob', punct='?') }}",
    "{%- macro render(x) -%}\n  {%- if x is mapping -%}{{ x | tojson }}{%- else -%}{{ x }}{%- endif -%}\n{%- endmacro -%}\n{{ render(d) }}|{{ render(n) }}",
    "{% macro m() %}{{ g }}{% endmacro %}{% set g = 5 %}{{ m() }}",
    "{% for i in [1] %}{% macro m() %}{{ i }}{% endmacro %}{{ m() }}{% endfor %}",
    "{% macro m(x) %}{{ x }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, k=3) }}",
    # printf-style formatting
    "{{ '%s and %d' % ('a', 3) }} {{ '%s' % n }} {{ '%05.2f|%-4s|%r' % (f, 'x', 'y') }} {{ '%(a)s' % {'a': 1} }} {{ '%s-%s' | format('a', 'b') }} {{ '100%%' % () }}",
    "{{ 3.0 | string }} {{ 1e100 }} {{ 12345678901234567.0 }} {{ 0.0001 }} {{ 0.00001 }} {{ -0.0 }} {{ 7 // 2.0 }} {{ 2 ** -1 }} {{ 2 ** 0.5 }}",
    # slicing
    "{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ 'hello'[1:3] }} {{ u[::-1] }} {{ u[2:5] }} {{ xs[5:] }} {{ xs[-10:2] }}",
    # filters
    "{{ s | trim }}|{{ s | length }}|{{ u | length }}|{{ s | upper }}|{{ s | lower }}|{{ 'hello world' | capitalize }}|{{ 'hello wORLD-x (a' | title }}",
    "{{ xs | first }} {{ xs | last }} {{ xs | join(', ') }} {{ words | join }} {{ 'abc' | list }} {{ d | list }} {{ xs | sort }} {{ xs | reverse | list }}",
    "{{ d | items | list }} {{ n | string }} {{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 3.9 | int }} {{ '2.5' | float }} {{ n | float }}",
    "{{ s | replace('l', 'L') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ xs | sum }} {{ xs | max }} {{ xs | min }} {{ [1, 1, 2] | unique | list }}",
    "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ messages | tojson }}|{{ u | tojson }}|{{ [1.0, 2.5, none, true] | tojson }}",
    "{{ d | tojson(sort_keys=true) }}|{{ d | tojson(separators=(',', ':')) }}|{{ {} | tojson(indent=2) }}|{{ [] | tojson }}|{{ 'a\"b\\\\c\\n\\u0001' | tojson }}",
    "{{ people | selectattr('admin') | map(attribute='name') | list }} {{ people | rejectattr('admin') | map(attribute='name') | join(',') }}",
    "{{ people | selectattr('age', 'gt', 28) | map(attribute='name') | list }} {{ people | selectattr('name', 'equalto', 'bob') | list | length }}",
    "{{ xs | select('odd') | list }} {{ xs | reject('odd') | list }} {{ words | map('upper') | list }} {{ people | map(attribute='admin', default=false) | list }}",
    "{{ -3 | abs }} {{ 2.567 | round(2) }} {{ 2.5 | round }} {{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'x y  z' | wordcount }}",
    "{{ people | sort(attribute='age') | map(attribute='name') | list }} {{ words | sort(reverse=true) }} {{ '<a&b>' | e }} {{ d | dictsort }}",
    "{{ 'abc' | center(9) }}|{{ 'ab' | center(9) }}|",
    "{{ 0 | round }} {{ true | round }} {{ 7 | round(1) }} {{ 'False' | min }} {{ ['b', 'A', 'c'] | max }} {{ 0.5 is even }} {{ 3.0 is odd }}",
    "{{ [1, 2] is upper }} {{ '' is upper }} {{ 'A1' is upper }} {{ missing is lower }} {{ 'é' is lower }}",
    "{{ [1] in {'k': 1} }}",
    "{{ 'x' is odd }}",
    # tests
    "{{ 'x' is string }} {{ 1 is string }} {{ d is mapping }} {{ xs is mapping }} {{ xs is iterable }} {{ 'x' is iterable }} {{ n is iterable }} {{ missing is iterable }}",
    "{{ no is none }} {{ n is number }} {{ n is integer }} {{ f is float }} {{ t is boolean }} {{ t is true }} {{ false is false }} {{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }}",
    "{{ n is eq 7 }} {{ n is gt 3 }} {{ n is lt(3) }} {{ 'a' is in 'abc' }} {{ n is not none }} {{ no is sameas none }} {{ 'ab' is lower }} {{ 'AB' is upper }}",
    "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 5) }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }}",
    # string methods
    "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxhixx'.strip('x') }}|{{ s.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b c'.split(' ', 1) }}",
    "{{ s.startswith('  He') }} {{ s.endswith(('x', '  ')) }} {{ s.upper() }} {{ s.lower() }} {{ s.replace('o', '0') }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }}",
    "{{ 'a-b-c'.rsplit('-', 1) }} {{ 'hello'.find('l') }} {{ 'hello'.count('l') }} {{ ', '.join(words) }} {{ 'a\nb'.splitlines() }} {{ '12'.isdigit() }} {{ u.find('c') }}",
    "{{ xs.index(2) }} {{ xs.count(3) }}",
    "{{ '{} and {}'.format('a', n) }} {{ '{1}{0}{{x}}'.format('a', 'b') }} {{ '{name}!r={name!r}'.format(name='q') }}",
    # Unicode: case mapping and whitespace as Python's str sees them
    "{{ u | upper }}|{{ 'ÉCOLE Ωμέγα' | lower }}|{{ 'élan vital ǆ' | title }}|{{ 'ébène' | capitalize }}|{{ 'straße'.upper() }}",
    "[{{ '\u00a0\u3000 x\u2003' | trim }}]{{ 'a\u00a0b\u3000c'.split() }}{{ 'ü1'.isalnum() }}{{ 'ü'.isalpha() }}{{ '\u2003'.isspace() }}",
    # errors
    "{{ raise_exception('Bad: ' ~ n) }}",
    "{% if %}",
    "{% for x in xs %}",
    "{% if t %}{% endfor %}",
    "{{ 1 + }}",
    "{{ 'a' + 1 }}",
    "{{ xs.append(4) }}",
    "{% set ns = namespace(a=1) %}{% set ns._x = 1 %}",
    "{{ unknown_fn() }}",
    "{{ x | nosuchfilter }}",
    "{% unknowntag %}",
    "{{ 1 / 0 }}",
    "{{ 2 ** 62 }} {{ (-1) ** 1000000000000 }} {{ 3 ** 39 }} {{ -2 ** 63 }} {{ 9223372036854775807 - 1 }}",
]


def jinja2_render(template, ctx):
    try:
        return {"text": cu._compile_jinja_template(template).render(**ctx)}
    except Exception as e:  # noqa: BLE001 - every failure counts, whatever its class
        return {"error": str(e), "class": type(e).__name__}


_rendered = {}


def wick_render(template):
    if not Path(RENDER).exists():
        pytest.skip(f"{RENDER} is not built")
    if not _rendered:
        for t in TEMPLATES:
            p = subprocess.run([RENDER], input=json.dumps({"template": t, "contexts": [CTX]}), capture_output=True,
                               text=True, timeout=60)
            assert p.returncode == 0, (t, p.stderr)
            _rendered[t] = json.loads(p.stdout)[0]
    return _rendered[template]


@pytest.mark.parametrize("template", TEMPLATES, ids=range(len(TEMPLATES)))
def test_renders_as_jinja2(template):
    want = jinja2_render(template, CTX)
    got = wick_render(template)
    if "error" in want:
        assert "error" in got, f"jinja2 raised {want}; wick rendered {got.get('text')!r}"
        message = got["error"]
        if want["class"] == "TemplateSyntaxError":  # wick's names the line first
            assert re.match(r"line \d+: ", message), message
            message = message.split(": ", 1)[1]
        assert message == want["error"]
        return
    assert "error" not in got, f"wick failed: {got['error']}"
    assert got["text"] == want["text"]


def random_template(rng, depth=0):
    """Text, prints, comments, if/else, for and set in random nesting, every
    tag with a random `-`, `+` or nothing on each side."""
    def sign():
        return rng.choice(["", "-", "+"])

    def piece(d):
        r = rng.random()
        if r < 0.3:
            return rng.choice(["", " ", "  ", "\n", " \n", "\n  ", "\t", "a", " a ", "\n\n", "x\n  ", "\r\n", "  \n\t "])
        if r < 0.45:
            return "{{" + rng.choice(["", "-"]) + " 'v' " + rng.choice(["", "-"]) + "}}"
        if r < 0.55:
            return "{#" + rng.choice(["", "-"]) + " c " + rng.choice(["", "-"]) + "#}"
        if r < 0.7 and d < 3:
            return (f"{{%{sign()} if x {sign()}%}}" + body(d + 1) + f"{{%{sign()} else {sign()}%}}" + body(d + 1) +
                    f"{{%{sign()} endif {sign()}%}}")
        if r < 0.85 and d < 3:
            return f"{{%{sign()} for i in [1, 2] {sign()}%}}" + body(d + 1) + f"{{%{sign()} endfor {sign()}%}}"
        return f"{{%{sign()} set y = 1 {sign()}%}}"

    def body(d):
        return "".join(piece(d) for _ in range(rng.randint(0, 4)))

    return body(depth) + rng.choice(["", "\n", "\n\n", " \n"])


def test_whitespace_control_matches_on_random_templates():
    """trim_blocks, lstrip_blocks and `-`/`+` on 300 random templates, with x true and false."""
    import random
    if not Path(RENDER).exists():
        pytest.skip(f"{RENDER} is not built")
    rng = random.Random(35)
    for _ in range(300):
        template = random_template(rng)
        contexts = [{"x": True}, {"x": False}]
        p = subprocess.run([RENDER], input=json.dumps({"template": template, "contexts": contexts}),
                           capture_output=True, text=True, timeout=60)
        got = json.loads(p.stdout)
        for context, g in zip(contexts, got):
            want = jinja2_render(template, context)
            assert g.get("text") == want.get("text"), (template, context, want, g)
