"""Chat templates: wick's Jinja engine renders the chat templates of LLaMA-2,
3, 3.1 and 3.2, Qwen2.5 and Qwen3, Mistral-7B-Instruct v0.1 and v0.3, Gemma-2
and 3, Phi-3, 3.5, 4 and 4-mini, SmolLM2, Zephyr and DeepSeek-R1-Distill byte
for byte as transformers' apply_chat_template
renders them (its own render_jinja_template: jinja2's immutable sandbox with
trim_blocks, lstrip_blocks, loopcontrols and its globals), on conversations
that take every branch: with and without a system message, several turns,
add_generation_prompt on and off, tools and tool calls, reasoning, and the
conversations a template refuses (raise_exception's message, verbatim). The
{% generation %} spans equal transformers' assistant masks' spans."""
import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from chat_templates import TEMPLATES

cu = pytest.importorskip("transformers.utils.chat_template_utils")
jinja2 = pytest.importorskip("jinja2")

BUILD = Path(os.environ.get("WICK", Path(__file__).resolve().parents[2] / "build" / "bin" / "wick")).parent
RENDER = os.environ.get("WICK_RENDER_TEMPLATE", str(BUILD / "wick_render_template"))

# Templates wick cannot render yet: name -> why (their comparisons are expected failures).
GAPS: dict[str, str] = {}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. \"Köln\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
        "return": {"type": "number"},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                              "parameters": {"type": "object", "properties": {}}}}

SYSTEM = {"role": "system", "content": "You are a terse assistant.\n  Answer in one line. "}
USER1 = {"role": "user", "content": "  What's 2+2? Ünïcödé → ✓, \"quotes\" & <tags>\n"}
ASSISTANT1 = {"role": "assistant", "content": " 4.\n"}
USER2 = {"role": "user", "content": "And 3*3?\tTabs\\backslashes"}
ASSISTANT2 = {"role": "assistant", "content": "9"}
USER3 = {"role": "user", "content": "Thanks! 🙂"}

TOOL_CALL = {"role": "assistant", "content": "",
             "tool_calls": [{"id": "call12345", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Köln", "unit": "celsius"}}}]}
TOOL_CALL_TEXT = {"role": "assistant", "content": "Let me check.",
                  "tool_calls": [{"id": "call12345", "type": "function",
                                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                 {"id": "call67890", "type": "function",
                                  "function": {"name": "get_time", "arguments": {}}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "{\"temp\": 21.5}"}
TOOL_RESULT2 = {"role": "tool", "tool_call_id": "call67890", "name": "get_time", "content": "12:00"}
WEATHER_Q = {"role": "user", "content": "Weather in Köln?"}
WEATHER_A = {"role": "assistant", "content": "It is 21.5 °C in Köln."}
# DeepSeek's template concatenates the arguments, so they come as a string.
DEEPSEEK_TOOL_CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Köln\"}"}},
    {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
THINKING = {"role": "assistant", "content": "<think>\nLet me add.\n</think>\n\n4"}
REASONING = {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."}


def case(messages, add_generation_prompt=False, tools=None, **kwargs):
    return {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools, "kwargs": kwargs}


SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

BASIC = {
    "one_turn": case([USER1]),
    "one_turn_prompt": case([USER1], add_generation_prompt=True),
    "system": case([SYSTEM, USER1, ASSISTANT1]),
    "system_prompt": case([SYSTEM, USER1, ASSISTANT1, USER2], add_generation_prompt=True),
    "turns": case([USER1, ASSISTANT1, USER2, ASSISTANT2, USER3]),
    "turns_prompt": case([USER1, ASSISTANT1, USER2, ASSISTANT2, USER3], add_generation_prompt=True),
    "ends_with_assistant": case([USER1, ASSISTANT1, USER2, ASSISTANT2]),
    "empty_system": case([{"role": "system", "content": ""}, USER1]),
}
ALTERNATION = {
    "not_alternating": case([USER1, USER2]),
    "starts_with_assistant": case([ASSISTANT1, USER1]),
}
TOOLS = {
    "tools": case([WEATHER_Q], add_generation_prompt=True, tools=[WEATHER_TOOL, TIME_TOOL]),
    "tools_system": case([SYSTEM, WEATHER_Q], add_generation_prompt=True, tools=[WEATHER_TOOL]),
    "tool_call": case([WEATHER_Q, TOOL_CALL, TOOL_RESULT, WEATHER_A], tools=[WEATHER_TOOL]),
    "tool_call_prompt": case([SYSTEM, WEATHER_Q, TOOL_CALL, TOOL_RESULT], add_generation_prompt=True,
                             tools=[WEATHER_TOOL]),
}
MULTI_TOOL = {
    "two_tool_calls": case([WEATHER_Q, TOOL_CALL_TEXT, TOOL_RESULT, TOOL_RESULT2, WEATHER_A],
                           tools=[WEATHER_TOOL, TIME_TOOL]),
}
LLAMA_EXTRA = {
    "date": case([USER1], add_generation_prompt=True, date_string="1 Jan 2025"),
    "tools_in_system": case([SYSTEM, WEATHER_Q], add_generation_prompt=True, tools=[WEATHER_TOOL],
                            tools_in_user_message=False, date_string="1 Jan 2025"),
    "tools_without_user": case([SYSTEM], tools=[WEATHER_TOOL], date_string="1 Jan 2025"),
    "tool_dict_content": case([WEATHER_Q, TOOL_CALL, {"role": "tool", "content": {"temp": 21.5, "ok": True}}],
                              tools=[WEATHER_TOOL], date_string="1 Jan 2025"),
    "two_tool_calls": case([WEATHER_Q, TOOL_CALL_TEXT], tools=[WEATHER_TOOL], date_string="1 Jan 2025"),
}
BUILTIN = {
    "builtin_tools": case([WEATHER_Q, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "Köln weather"}}}]},
        {"role": "ipython", "content": "sunny"}], builtin_tools=["brave_search", "code_interpreter"],
        date_string="1 Jan 2025"),
}
QWEN3_EXTRA = {
    "thinking_in_content": case([USER1, THINKING, USER2, THINKING]),
    "reasoning_content": case([USER1, REASONING]),
    "reasoning_earlier_turn": case([USER1, REASONING, USER2], add_generation_prompt=True),
    "reasoning_older_name": case([USER1, {"role": "assistant", "content": "4", "reasoning": "Add."}]),
    "thinking_name": case([USER1, {"role": "assistant", "content": "4", "thinking": "Sum."}]),
    "no_thinking": case([USER1], add_generation_prompt=True, enable_thinking=False),
    "thinking_on": case([USER1], add_generation_prompt=True, enable_thinking=True),
    "tool_response_as_user": case([WEATHER_Q, TOOL_CALL, {"role": "user", "content": "<tool_response>x</tool_response>"},
                                   TOOL_CALL_TEXT], tools=[WEATHER_TOOL]),
    "string_arguments": case([WEATHER_Q, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]}], tools=[TIME_TOOL]),
    "list_content": case([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, ASSISTANT1]),
}
MISTRAL_EXTRA = {
    "bad_tool_id": case([WEATHER_Q, {"role": "assistant", "tool_calls": [
        {"id": "short", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]}], tools=[WEATHER_TOOL]),
    "unknown_role": case([USER1, {"role": "narrator", "content": "x"}]),
}
GEMMA3_EXTRA = {
    "multimodal": case([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]}],
                       add_generation_prompt=True),
    "bad_content": case([{"role": "user", "content": 42}]),
}
PHI4_EXTRA = {
    "system_tools": case([{"role": "system", "content": "Use tools.", "tools": json.dumps([WEATHER_TOOL])}, WEATHER_Q],
                         add_generation_prompt=True),
}

CASES = {
    "llama-3.1-instruct": {**BASIC, **TOOLS, **LLAMA_EXTRA, **BUILTIN},
    "llama-3.2-instruct": {**BASIC, **TOOLS, **LLAMA_EXTRA},
    "qwen2.5-instruct": {**BASIC, **TOOLS, **MULTI_TOOL},
    "qwen3": {**BASIC, **TOOLS, **MULTI_TOOL, **QWEN3_EXTRA},
    "mistral-7b-instruct-v0.3": {**BASIC, **ALTERNATION, **TOOLS, **MULTI_TOOL, **MISTRAL_EXTRA},
    "gemma-2-it": {**BASIC, **ALTERNATION},
    "gemma-3-it": {**BASIC, **ALTERNATION, **GEMMA3_EXTRA},
    "phi-3-mini-instruct": BASIC,
    "phi-3.5-mini-instruct": BASIC,
    "phi-4-mini-instruct": {**BASIC, **PHI4_EXTRA},
    "smollm2-instruct": BASIC,
    "chatml-generation": BASIC,
    "chatml-generation-macro": BASIC,
    "llama-2-chat": {**BASIC, **ALTERNATION},
    "llama-3-instruct": BASIC,
    "mistral-7b-instruct-v0.1": {**BASIC, **ALTERNATION, "system_refused": case([SYSTEM, USER1])},
    "zephyr-7b-beta": BASIC,
    "phi-4": BASIC,
    "deepseek-r1-distill-qwen": {**BASIC, "thinking": case([USER1, THINKING, USER2], add_generation_prompt=True),
                                 "tool_calls": case([WEATHER_Q, DEEPSEEK_TOOL_CALLS, TOOL_RESULT, TOOL_RESULT2,
                                                     WEATHER_A], add_generation_prompt=True),
                                 "ends_in_tool": case([WEATHER_Q, DEEPSEEK_TOOL_CALLS, TOOL_RESULT],
                                                      add_generation_prompt=True)},
}


def reference(template, c):
    """transformers' rendering: (text, generation spans in characters), or the error's message."""
    try:
        texts, spans = cu.render_jinja_template(
            conversations=[copy.deepcopy(c["messages"])], tools=c["tools"], chat_template=template,
            add_generation_prompt=c["add_generation_prompt"], return_assistant_tokens_mask=True,
            **SPECIALS, **c["kwargs"])
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}
    return {"text": texts[0], "spans": [list(s) for s in spans[0]]}


def chat(c):
    """The conversation as ChatTemplate::apply takes it (which aliases the reasoning as transformers does)."""
    return {"messages": c["messages"], "tools": c["tools"], "add_generation_prompt": c["add_generation_prompt"],
            "variables": {**SPECIALS, **c["kwargs"]}}


_rendered = {}


def wick_render(name):
    if name not in _rendered:
        if not Path(RENDER).exists():
            pytest.skip(f"{RENDER} is not built")
        cases = CASES[name]
        request = {"template": TEMPLATES[name], "chats": [chat(c) for c in cases.values()]}
        p = subprocess.run([RENDER], input=json.dumps(request), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        _rendered[name] = dict(zip(cases, json.loads(p.stdout)))
    return _rendered[name]


def char_spans(text, spans):
    data = text.encode()
    return [[len(data[:b].decode()), len(data[:e].decode())] for b, e in spans]


@pytest.mark.parametrize("name,case_name", [(n, k) for n, cases in CASES.items() for k in cases])
def test_renders_as_transformers(name, case_name):
    if name in GAPS:
        pytest.xfail(GAPS[name])
    want = reference(TEMPLATES[name], CASES[name][case_name])
    got = wick_render(name)[case_name]
    if "error" in want:
        assert "error" in got, f"transformers raised {want['error']!r}; wick rendered {got.get('text')!r}"
        assert got["error"] == want["error"]
        return
    assert "error" not in got, f"wick failed: {got['error']}"
    assert got["text"] == want["text"]
    assert char_spans(got["text"], got["spans"]) == want["spans"]


def test_every_branch_is_taken():
    """Each template's cases include ones that raise when the template can."""
    for name, cases in CASES.items():
        raises = "raise_exception" in TEMPLATES[name]
        errors = [k for k, c in cases.items() if "error" in reference(TEMPLATES[name], c)]
        assert bool(errors) == raises, (name, errors)
