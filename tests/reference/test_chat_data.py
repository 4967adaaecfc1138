"""Chat data: data `text`'s token ids and labels for TRL's conversational
rows equal transformers' on model folders (tokenizer.json,
tokenizer_config.json with the chat template and special tokens), on
templates with {% generation %} (transformers' apply_chat_template(...,
return_assistant_tokens_mask=True)) and without (each assistant turn from the
render of the messages before it with the generation prompt to the render of
the messages up to it, marked through transformers' char_to_token), for
byte-level and byte-fallback (LLaMA-2's Prepend/Replace) tokenizers, with
system messages and several turns; {"prompt", "completion"} lists of
messages as TRL's SFTTrainer masks them (the prompt rendered with the
generation prompt). wick.tokenizer's encode, decode and apply_chat_template
against the same tokenizer's."""
import json

import pytest

from chat_templates import TEMPLATES
from test_tokenizer_vs_tokenizers import MULTILINGUAL, added, build_byte_fallback

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|user|>",
            "<|assistant|>", "<|system|>", "<|end|>", "<s>", "</s>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
            "<｜User｜>", "<｜Assistant｜>"]
# which special tokens each template's folder names in tokenizer_config.json
TOKENS = {
    "chatml-generation": {"eos_token": "<|im_end|>"},
    "chatml-generation-macro": {"eos_token": "<|im_end|>"},
    "qwen2.5-instruct": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "smollm2-instruct": {"eos_token": "<|im_end|>"},
    "llama-3.1-instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "gemma-2-it": {"bos_token": "<bos>", "eos_token": "<end_of_turn>"},
    "phi-3-mini-instruct": {"eos_token": "<|end|>"},
    "llama-2-chat": {"bos_token": "<s>", "eos_token": "</s>"},
    "mistral-7b-instruct-v0.1": {"bos_token": "<s>", "eos_token": "</s>"},
    "zephyr-7b-beta": {"eos_token": "</s>"},
    "qwen3": {"eos_token": "<|im_end|>"},
    "gemma-3-it": {"bos_token": "<bos>", "eos_token": "<end_of_turn>"},
    "phi-4": {"eos_token": "<|im_end|>"},
    "llama-3.2-instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral-7b-instruct-v0.3": {"bos_token": "<s>", "eos_token": "</s>"},
    "deepseek-r1-distill-qwen": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
}
GENERATION = ["chatml-generation", "chatml-generation-macro"]

SYSTEM = {"role": "system", "content": "You are a terse assistant.\n  Answer in one line. "}
USER1 = {"role": "user", "content": "  What's 2+2? Ünïcödé → ✓, \"quotes\" & <tags>\n"}
ASSISTANT1 = {"role": "assistant", "content": " 4.\n"}
USER2 = {"role": "user", "content": "And 3*3?\tTabs\\backslashes Grüße aus Köln"}
ASSISTANT2 = {"role": "assistant", "content": "9, nine: Übermäßige Straßenbahnfahrten"}
CONVERSATIONS = [
    [USER1, ASSISTANT1],
    [SYSTEM, USER1, ASSISTANT1],
    [USER1, ASSISTANT1, USER2, ASSISTANT2],
    [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2],
]


def byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    texts = MULTILINGUAL * 4 + [m["content"] for c in CONVERSATIONS for m in c] * 4
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def byte_fallback():
    """LLaMA-2's kind (Prepend and Replace normalizers: each text between
    added tokens starts with the metaspace), with the templates' tokens added."""
    tok = build_byte_fallback("llama2", MULTILINGUAL * 4)
    j = json.loads(tok.to_str())
    n = max(a["id"] for a in j["added_tokens"]) + 1
    have = {a["content"] for a in j["added_tokens"]}
    for k, t in enumerate(t for t in SPECIALS if t not in have):
        j["added_tokens"].append(added(t, n + k))
    return Tokenizer.from_str(json.dumps(j))


def byte_level_trim():
    """byte_level with GPT-NeoX's post-processor: ByteLevel with trim_offsets,
    whose offsets leave each token's spaces out (so char_to_token finds no
    token at a span that starts with a space)."""
    tok = byte_level()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True)
    return tok


TOKENIZERS = {"byte_level": byte_level, "byte_fallback": byte_fallback}
MORE_TOKENIZERS = {"byte_level_trim": byte_level_trim}
_built = {}


def folder(tmp_path, kind, name):
    """A model folder as transformers saves one: tokenizer.json and tokenizer_config.json."""
    if kind not in _built:
        _built[kind] = {**TOKENIZERS, **MORE_TOKENIZERS}[kind]().to_str()
    d = tmp_path / f"{kind}-{name}"
    d.mkdir()
    (d / "tokenizer.json").write_text(_built[kind])
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[name], **TOKENS[name]}))
    return d


DATA_RECIPE = """
local wick = require "wick"
local data = wick.data("text", { file = wick.args.file, tokenizer = wick.args.tokenizer, cache_dir = "none",
                                 max_length = 4096,
                                 assistant_only_loss = tostring(wick.args.assistant_only_loss) ~= "false" })
for i = 0, data:size() - 1 do
  local w = data:window(i, 1)
  w:save(wick.args.dir .. "/" .. i .. ".safetensors")
end
"""


def wick_rows(tmp_path, run_wick, model_dir, rows, **args):
    """The (input_ids, labels) of each row as data `text` gives them."""
    from safetensors.torch import load_file
    out = tmp_path / "rows"
    out.mkdir(exist_ok=True)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.lua").write_text(DATA_RECIPE)
    run_wick("run", tmp_path / "r.lua", f"file={tmp_path / 'd.jsonl'}", f"tokenizer={model_dir}", f"dir={out}",
             *[f"{k}={v}" for k, v in args.items()])
    got = []
    for i in range(len(rows)):
        w = load_file(str(out / f"{i}.safetensors"))
        got.append((w["0.input_ids"][0].tolist(), w["0.labels"][0].tolist()))
    return got


def mask_from_spans(enc, spans, n):
    """transformers' return_assistant_tokens_mask loop over character spans."""
    mask = [0] * n
    for start, end in spans:
        s, e = enc.char_to_token(start), enc.char_to_token(end - 1)
        if s is None:
            break
        for t in range(s, e + 1 if e else n):
            mask[t] = 1
    return mask


END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>"]


def turn_spans(tok, messages, text, **kw):
    """Each assistant turn: from the render of the messages before it with
    the generation prompt to the render of the messages up to it, where both
    begin the text; else (a template that ends the conversation otherwise,
    as Phi-3's appends an end) the content found after the previous turn,
    with the first end-of-turn token of END_OF_TURN the text holds after it."""
    eot = next((t for t in END_OF_TURN if t in tok.get_vocab() and t in text), "")
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kw)
        turn = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kw)
        if cursor <= len(head) < len(turn) and turn.startswith(head) and text.startswith(turn):
            spans.append((len(head), len(turn)))
        else:
            content = m["content"]
            at = text.find(content, cursor)
            if at < 0:
                content = content.strip(" \t\r\n")
                at = text.find(content, cursor)
            assert at >= 0, (m, text)
            end = at + len(content)
            if eot and text.startswith(eot, end):
                end += len(eot)
            spans.append((at, end))
        cursor = spans[-1][1]
    return spans


def reference(tok, messages, generation, **kw):
    if generation:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kw)
        ids, mask = out["input_ids"], out["assistant_masks"]
    else:
        text = tok.apply_chat_template(messages, tokenize=False, **kw)
        enc = tok(text, add_special_tokens=False)
        ids = enc["input_ids"]
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]
        mask = mask_from_spans(enc, turn_spans(tok, messages, text, **kw), len(ids))
    return ids, [i if m else -100 for i, m in zip(ids, mask)]


def renders(tok, messages):
    try:
        tok.apply_chat_template(messages, tokenize=False)
        return True
    except Exception:  # the template refuses it (a system message, ...)
        return False


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("name", list(TOKENS))
def test_messages_ids_and_assistant_labels_equal_transformers(tmp_path, run_wick, kind, name):
    d = folder(tmp_path, kind, name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    convs = [c for c in CONVERSATIONS if renders(tok, c)]
    assert len(convs) >= 2, name
    got = wick_rows(tmp_path, run_wick, d, [{"messages": c} for c in convs])
    for c, (ids, labels) in zip(convs, got):
        want_ids, want_labels = reference(tok, c, name in GENERATION)
        assert ids == want_ids, (name, c)
        assert labels == want_labels, (name, c, tok.decode([i for i in labels if i >= 0]))
        assert sum(x >= 0 for x in labels) > 0


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_a_rows_tools_and_chat_template_kwargs_reach_the_template(tmp_path, run_wick, kind):
    """TRL's columns: tools (Qwen2.5 lists them in its system turn) and
    chat_template_kwargs (Qwen3's enable_thinking)."""
    rows = [("qwen2.5-instruct", {"tools": [WEATHER_TOOL]}), ("qwen3", {"enable_thinking": False})]
    for name, kw in rows:
        d = folder(tmp_path, kind, name)
        tok = transformers.AutoTokenizer.from_pretrained(str(d))
        row = {"messages": CONVERSATIONS[2]}
        if "tools" in kw:
            row["tools"] = kw["tools"]
        else:
            row["chat_template_kwargs"] = kw
        (ids, labels), = wick_rows(tmp_path, run_wick, d, [row])
        assert (ids, labels) == reference(tok, CONVERSATIONS[2], False, **kw), name
        assert (ids, labels) != reference(tok, CONVERSATIONS[2], False), name  # they changed the rendering


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("name", ["chatml-generation", "qwen2.5-instruct"])
def test_without_assistant_only_loss_every_token_counts(tmp_path, run_wick, kind, name):
    d = folder(tmp_path, kind, name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    got = wick_rows(tmp_path, run_wick, d, [{"messages": CONVERSATIONS[2]}], assistant_only_loss="false")
    want = tok.apply_chat_template(CONVERSATIONS[2], tokenize=True, return_dict=True)["input_ids"]
    assert got[0] == (want, want)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3.1-instruct", "llama-2-chat", "chatml-generation"])
def test_prompt_completion_messages_are_masked_as_trl_masks_them(tmp_path, run_wick, kind, name):
    d = folder(tmp_path, kind, name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    rows = [{"prompt": [SYSTEM, USER1], "completion": [ASSISTANT1]},
            {"prompt": [USER1, ASSISTANT1, USER2], "completion": [ASSISTANT2]}]
    rows = [r for r in rows if renders(tok, r["prompt"] + r["completion"])]
    got = wick_rows(tmp_path, run_wick, d, rows)
    for r, (ids, labels) in zip(rows, got):
        prompt = tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)
        full = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"]
        n = len(prompt["input_ids"])
        assert ids == full
        assert labels == [-100] * n + full[n:]


TOKENIZER_RECIPE = """
local wick = require "wick"
local tok = wick.tokenizer(wick.args.dir)
local f = assert(io.open(wick.args.cases))
local cases = wick.core.json_decode(f:read("*a"))
f:close()
local out = {}
for i, c in ipairs(cases) do
  local ids = tok:encode(c.text)
  out[i] = {
    ids = ids,
    plain = tok:encode(c.text, { add_special_tokens = false }),
    text = tok:decode(ids),
    skipped = tok:decode(ids, { skip_special_tokens = true }),
    chat = tok:apply_chat_template(c.messages, { tokenize = false, add_generation_prompt = true }),
    chat_ids = tok:apply_chat_template(c.messages, { add_generation_prompt = true }),
  }
end
wick.core.write_file(wick.args.result, wick.json(out))
"""


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_wick_tokenizer_equals_the_transformers_tokenizer(tmp_path, run_wick, kind):
    name = "llama-3.1-instruct" if kind == "byte_level" else "llama-2-chat"
    d = folder(tmp_path, kind, name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    cases = [{"text": "<s>Grüße aus Köln</s> and <|eot_id|>", "messages": [USER1]},
             {"text": MULTILINGUAL[2], "messages": [USER1, ASSISTANT1, USER2]}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "t.lua").write_text(TOKENIZER_RECIPE)
    run_wick("run", tmp_path / "t.lua", f"dir={d}", f"cases={tmp_path / 'cases.json'}",
             f"result={tmp_path / 'out.json'}")
    got = json.loads((tmp_path / "out.json").read_text())
    for c, g in zip(cases, got):
        ids = tok.encode(c["text"])
        assert g["ids"] == ids
        assert g["plain"] == tok.encode(c["text"], add_special_tokens=False)
        assert g["text"] == tok.decode(ids)
        assert g["skipped"] == tok.decode(ids, skip_special_tokens=True)
        assert g["chat"] == tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
        assert g["chat_ids"] == tok.apply_chat_template(c["messages"], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]


CONTINUE_RECIPE = """
local wick = require "wick"
local tok = wick.tokenizer(wick.args.dir)
local data = wick.data("text", { tokenizer = wick.args.dir })  -- the tokenizer alone, through the data plugin
local f = assert(io.open(wick.args.cases))
local cases = wick.core.json_decode(f:read("*a"))
f:close()
local out = {}
for i, c in ipairs(cases) do
  local o = { tokenize = false }
  for k, v in pairs(c.options) do o[k] = v end
  local r = { text = tok:apply_chat_template(c.messages, o) }
  r.data_text = data:apply_chat_template(c.messages, o)
  o.tokenize = true
  r.ids = tok:apply_chat_template(c.messages, o)
  o.return_dict = true
  r.dict = tok:apply_chat_template(c.messages, o)
  out[i] = r
end
wick.core.write_file(wick.args.result, wick.json(out))
"""

PARTIAL = {"role": "assistant", "content": "9, nine: Über "}  # a trailing space some templates trim
CONTINUE_TEMPLATES = ["qwen2.5-instruct", "llama-3.1-instruct", "gemma-2-it", "mistral-7b-instruct-v0.3",
                      "phi-3-mini-instruct", "qwen3"]


@pytest.mark.parametrize("name", CONTINUE_TEMPLATES)
def test_continue_final_message_equals_transformers(tmp_path, run_wick, name):
    """wick.tokenizer's apply_chat_template(continue_final_message = true) ends
    the render inside the final message as transformers' does (its tag after
    the message, the render cut there, trimmed where the template trimmed the
    message), as text, ids and a return_dict table, and so does a data set's
    data:apply_chat_template; qwen3 also continues the reasoning
    (continue_final_message = "reasoning_content")."""
    d = folder(tmp_path, "byte_level", name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    cases = [{"messages": [USER1, ASSISTANT1, USER2, PARTIAL], "options": {"continue_final_message": True}},
             {"messages": [USER2, {"role": "assistant", "content": "Sure"}],
              "options": {"continue_final_message": True}}]
    if name == "qwen3":
        cases.append({"messages": [USER2, {"role": "assistant", "content": "", "reasoning_content": "Let me think"}],
                      "options": {"continue_final_message": "reasoning_content"}})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "t.lua").write_text(CONTINUE_RECIPE)
    run_wick("run", tmp_path / "t.lua", f"dir={d}", f"cases={tmp_path / 'cases.json'}", f"result={tmp_path / 'out.json'}")
    got = json.loads((tmp_path / "out.json").read_text())
    for c, g in zip(cases, got):
        want = tok.apply_chat_template(c["messages"], tokenize=False, **c["options"])
        assert g["text"] == want and g["data_text"] == want
        assert not want.endswith("<|im_end|>\n") and not want.endswith("<|eot_id|>")  # the render stops inside
        ids = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True, **c["options"])
        assert g["ids"] == ids["input_ids"]
        assert g["dict"] == {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}


MASK_RECIPE = """
local wick = require "wick"
local tok = wick.tokenizer(wick.args.dir)
local f = assert(io.open(wick.args.cases))
local cases = wick.core.json_decode(f:read("*a"))
f:close()
local out = {}
for i, c in ipairs(cases) do
  out[i] = tok:apply_chat_template(c, { return_assistant_tokens_mask = true })
end
wick.core.write_file(wick.args.result, wick.json(out))
"""


@pytest.mark.parametrize("kind", list(TOKENIZERS) + list(MORE_TOKENIZERS))
@pytest.mark.parametrize("name", GENERATION + ["qwen2.5-instruct"])
def test_return_assistant_tokens_mask_equals_transformers(tmp_path, run_wick, kind, name):
    """return_assistant_tokens_mask = true gives transformers' dict: input_ids,
    attention_mask and assistant_masks (the {% generation %} blocks' tokens);
    a template without such blocks marks none, as transformers (which warns).
    With trim_offsets (byte_level_trim) a span that starts with a space
    (" 4.") starts where no token's trimmed offsets are: transformers marks
    otherwise than with untrimmed offsets, and so does wick."""
    d = folder(tmp_path, kind, name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    (tmp_path / "cases.json").write_text(json.dumps(CONVERSATIONS))
    (tmp_path / "t.lua").write_text(MASK_RECIPE)
    p = run_wick("run", tmp_path / "t.lua", f"dir={d}", f"cases={tmp_path / 'cases.json'}",
                 f"result={tmp_path / 'out.json'}")
    got = json.loads((tmp_path / "out.json").read_text())
    untrimmed = transformers.AutoTokenizer.from_pretrained(str(folder(tmp_path, "byte_level", name))) \
        if kind == "byte_level_trim" else tok
    # chatml-generation's span starts at the turn's text, " 4.": with trimmed offsets no token holds its
    # space, and transformers marks nothing from there on (the macro's spans start before, at its header)
    trim_breaks = (kind, name) == ("byte_level_trim", "chatml-generation")
    trimmed_apart = 0
    for messages, g in zip(CONVERSATIONS, got):
        want = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert g == {k: list(v) for k, v in want.items()}
        assert any(want["assistant_masks"]) == (name in GENERATION and not trim_breaks)
        other = untrimmed.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        trimmed_apart += other["assistant_masks"] != want["assistant_masks"]
    # there the trimmed offsets mark other tokens than untrimmed ones would, so the comparison can fail
    assert (trimmed_apart > 0) == trim_breaks, trimmed_apart
    assert ("no {% generation %} block" in p.stderr) == (name not in GENERATION)
