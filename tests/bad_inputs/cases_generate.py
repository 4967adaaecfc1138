"""`wick generate` and model:generate: every option goes through one schema
(an unknown key, a wrong type, a value out of range is refused by name before
a token is made); a prompt plus max_new_tokens beyond the model's context
(max_position_embeddings) is refused, not generated into positions the model
never learned; a recipe's on_token callback that is not a function, or that
fails, is named. A model folder without a tokenizer.json is refused (its ids
printed as bytes would be text that means nothing), naming the folder, the
tokenizer files it does hold and what to pass, unless tokenizer=bytes says the
model was trained on bytes. A chat (messages=) that is not JSON, not a list of
{role, content} objects, or meets a tokenizer without a chat template or a
template that raises or does not parse is refused, naming where the chat came
from and the message at fault; so are a repetition_penalty <= 0, stop strings
that are not strings, an adapter folder that is missing, empty or made for
another model, and a save_pretrained whose source files are broken (nothing
written)."""
from harness import Case
import json

from hf_files import tokenizer_json, write_adapter, write_decoder


def folder(**changes):
    return lambda d: write_decoder(d / "m", **changes)


def gen(name, args, message, setup=folder()):
    return Case(name, ["generate", "m", "tokenizer=bytes", "prompt=hi", *args], "generate: " + message, setup=setup)


def recipe(name, options, message, prompt="{1, 2}"):
    body = ('local wick = require "wick"\n'
            'local m = wick.model("decoder_lm", { vocab_size = 16, hidden_size = 8, intermediate_size = 16, '
            'layers = 1, heads = 2 })\n'
            f"m:generate({prompt}, {options})\n")
    return Case(name, ["run", "r.lua"], message, setup=lambda d: (d / "r.lua").write_text(body))


NO_TOKENIZER = (r"generate: the model folder m has no tokenizer\.json{}, so the ids the model makes cannot be turned "
                r"into text: pass tokenizer=PATH \(a tokenizer\.json, or a folder holding one\), or tokenizer=bytes "
                r"for a model trained on UTF-8 bytes .*or save the tokenizer with the model "
                r"\(wick\.save_pretrained\(model, dir, tokenizer_json\)\)$")


def with_files(*names):
    def setup(d):
        write_decoder(d / "m")
        for n in names:
            (d / "m" / n).write_text("{}\n")
    return setup


CASES = [
    Case("model folder without a tokenizer", ["generate", "m", "prompt=hi"], NO_TOKENIZER.format(" and no other tokenizer files"),
         setup=folder()),
    Case("model folder with a sentencepiece tokenizer only", ["generate", "m", "prompt=hi"],
         NO_TOKENIZER.format(r" \(it holds tokenizer\.model, tokenizer_config\.json, which wick does not read: it "
                             r"reads the tokenizer\.json that Hugging Face's tokenizers library saves\)"),
         setup=with_files("tokenizer.model", "tokenizer_config.json")),
    Case("tokenizer= a folder without tokenizer.json", ["generate", "m", "prompt=hi", "tokenizer=t"],
         r"generate: tokenizer=t is a folder without a tokenizer\.json, expected a tokenizer\.json file, a folder "
         r"holding one, or bytes", setup=lambda d: (write_decoder(d / "m"), (d / "t").mkdir())),
    Case("tokenizer= a file that is not there", ["generate", "m", "prompt=hi", "tokenizer=t.json"],
         r"generate: tokenizer=t\.json: no such file, expected a tokenizer\.json file, a folder holding one, or bytes",
         setup=folder()),

    gen("unknown generate key", ["foo=1"], r"unknown option 'foo' \(known options: max_new_tokens, "),
    gen("top_p not a number", ["top_p=nan"], r"option 'top_p': expected number, got string \"nan\""),
    gen("top_p zero", ["top_p=0"], r"option 'top_p': expected a value in \(0, 1\], got integer 0"),
    gen("top_p above one", ["top_p=1.5"], r"option 'top_p': expected a value in \(0, 1\], got number 1\.5"),
    gen("negative temperature", ["temperature=-1"], r"option 'temperature': expected a value >= 0, got integer -1"),
    gen("negative max_new_tokens", ["max_new_tokens=-1"], r"option 'max_new_tokens': expected a value >= 0"),
    gen("fractional max_new_tokens", ["max_new_tokens=2.5"], r"option 'max_new_tokens': expected integer, got number 2\.5"),
    gen("negative top_k", ["top_k=-3"], r"option 'top_k': expected a value >= 0, got integer -3"),
    gen("eos_id below -1", ["eos_id=-2"], r"option 'eos_id': expected a value >= -1, got integer -2"),
    gen("on_token on the command line", ["on_token=1"], r"on_token is a function for model:generate in a recipe"),
    gen("max_new_tokens past the default context", ["max_new_tokens=9999999"],
        r"a prompt of 2 tokens and max_new_tokens=9999999 exceed the model's context of 2048 positions "
        r"\(max_position_embeddings\), expected max_new_tokens <= 2046"),
    gen("max_new_tokens past a short context", ["max_new_tokens=7"],
        r"a prompt of 2 tokens and max_new_tokens=7 exceed the model's context of 8 positions "
        r"\(max_position_embeddings\), expected max_new_tokens <= 6",
        setup=folder(max_position_embeddings=8)),
    gen("prompt longer than the context", ["prompt=a-long-prompt", "max_new_tokens=1"],
        r"a prompt of 13 tokens and max_new_tokens=1 exceed the model's context of 8 positions "
        r"\(max_position_embeddings\), expected a prompt shorter than 8 tokens", setup=folder(max_position_embeddings=8)),
    Case("max_position_embeddings zero", ["generate", "m", "tokenizer=bytes", "max_new_tokens=1"],
         r"decoder_lm: m/config\.json: max_position_embeddings is 0, expected an integer of at least 1",
         setup=folder(max_position_embeddings=0)),
    Case("save_pretrained with a tokenizer that is not there", ["run", "r.lua"],
         r"r\.lua:3: save_pretrained: cannot read the tokenizer t\.json: No such file or directory$",
         setup=lambda d: (d / "r.lua").write_text(
             'local wick = require "wick"\n'
             'local m = wick.model("decoder_lm", { vocab_size = 16, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2 })\n'
             'wick.save_pretrained(m, "out", "t.json")\n')),
    recipe("on_token not a function", "{ on_token = 3 }", r"r\.lua:3: generate: option 'on_token': expected a function, got number"),
    recipe("on_token raises", '{ max_new_tokens = 2, on_token = function(id) error("stop here") end }',
           r"r\.lua:3: generate: on_token: r\.lua:3: stop here"),
    recipe("generate option of the wrong type", '{ top_k = "many" }', r"r\.lua:3: generate: option 'top_k': expected integer, got string \"many\""),
]

# ---- chats, repetition_penalty, stop strings, adapters, folders saved whole ----
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def chat_folder(template=TEMPLATE, extra=None):
    """m: the tiny decoder with a tokenizer.json and a tokenizer_config.json holding `template`."""
    def setup(d):
        write_decoder(d / "m")
        (d / "m" / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
        cfg = {"eos_token": "<|endoftext|>"}
        if template is not None:
            cfg["chat_template"] = template
        (d / "m" / "tokenizer_config.json").write_text(json.dumps(cfg))
        for name, text in (extra or {}).items():
            (d / name).write_text(text)
    return setup


def chat(name, messages, message, **kw):
    return Case(name, ["generate", "m", "messages=" + messages, "max_new_tokens=1"], "generate: " + message,
                setup=kw.pop("setup", chat_folder()), **kw)


def adapter(name, message, make):
    def setup(d):
        write_decoder(d / "m")
        make(d)
    return Case(name, ["generate", "m", "tokenizer=bytes", "prompt=hi", "max_new_tokens=1", "adapter=a"],
                "generate: adapter=a: " + message, setup=setup)


def save_recipe(d, src="m"):
    (d / "r.lua").write_text('local wick = require "wick"\n'
                             f'local m = wick.model("decoder_lm", {{ path = "{src}" }})\n'
                             'wick.save_pretrained(m, "out")\n')


def broken_generation_config(d):
    write_decoder(d / "m")
    (d / "m" / "generation_config.json").write_text('{"eos_token_id": [1, ')
    save_recipe(d)


def out_is_a_file(d):
    write_decoder(d / "m")
    (d / "out").write_text("notes\n")
    save_recipe(d)


USER = '[{"role": "user", "content": "hi"}]'

CASES += [
    chat("messages not valid JSON", '[{"role": "user"', r"messages \(inline JSON\): not valid JSON: "),
    chat("messages file not valid JSON", "c.json", r"messages=c\.json: not valid JSON: ",
         setup=chat_folder(extra={"c.json": '[{"role": "user", "content": "hi"},'})),
    chat("messages file that is not there", "c.json",
         r"messages=c\.json: no such file, expected a JSON file of \[\{\"role\", \"content\"\}, \.\.\.\], inline JSON, "
         r"or - for stdin"),
    chat("messages a folder", "m", r"messages=m is a folder, expected a JSON file"),
    chat("messages an object", '{"role": "user", "content": "hi"}',
         r"messages \(inline JSON\): expected a list of \{\"role\", \"content\"\} messages, got an object"),
    chat("messages an empty list", "[]", r"messages \(inline JSON\): the list is empty, expected at least one"),
    chat("message a string", '["hi"]',
         r"messages \(inline JSON\): messages\[0\]: expected an object with role and content, got a string"),
    chat("message without a role", '[{"content": "hi"}]',
         r"messages \(inline JSON\): messages\[0\]\.role: expected a string \(system, user, assistant, \.\.\.\), got nothing"),
    chat("message role a number", '[{"role": 1, "content": "hi"}]', r"messages \(inline JSON\): messages\[0\]\.role: expected a string .*got a number"),
    chat("message without content", '[{"role": "user", "content": "hi"}, {"role": "assistant"}]',
         r"messages \(inline JSON\): messages\[1\]\.content: missing, expected a string or a list of parts"),
    chat("message content a number", '[{"role": "user", "content": 5}]',
         r"messages \(inline JSON\): messages\[0\]\.content: expected a string or a list of parts, got a number"),
    Case("messages on stdin not JSON", ["generate", "m", "messages=-", "max_new_tokens=1"],
         r"generate: messages on stdin: not valid JSON: ", setup=chat_folder(), stdin="hello there\n"),
    Case("prompt and messages both", ["generate", "m", "prompt=hi", "messages=" + USER],
         r"generate: both prompt= and messages= are given, expected one", setup=chat_folder()),
    chat("messages for a tokenizer without a chat template", USER,
         r"messages \(inline JSON\): the tokenizer m/tokenizer\.json has no chat template \(no chat_template\.jinja, and "
         r"no chat_template in tokenizer_config\.json in m\), expected a chat model's tokenizer folder",
         setup=chat_folder(template=None)),
    chat("chat template raises", USER,
         r"messages \(inline JSON\): the chat template of m/tokenizer_config\.json \(line 1\) failed: Conversation roles "
         r"must alternate user/assistant$",
         setup=chat_folder(template="{% if messages[0]['role'] == 'user' %}{{ raise_exception('Conversation roles "
                                    "must alternate user/assistant') }}{% endif %}")),
    chat("chat template that does not parse", USER,
         r"messages \(inline JSON\): the chat template of m/tokenizer_config\.json does not parse: ",
         setup=chat_folder(template="{% for m in messages %}{{ m.content }")),
    Case("chat_template.jinja a folder", ["generate", "m", "messages=" + USER, "max_new_tokens=1"],
         r"m/chat_template\.jinja is a directory, expected a file",
         setup=lambda d: (chat_folder()(d), (d / "m" / "chat_template.jinja").mkdir())),
    gen("repetition_penalty zero", ["repetition_penalty=0"],
        r"option 'repetition_penalty': expected a value > 0, got integer 0"),
    gen("repetition_penalty negative", ["repetition_penalty=-1.5"],
        r"option 'repetition_penalty': expected a value > 0, got number -1\.5"),
    gen("repetition_penalty not a number", ["repetition_penalty=strong"],
        r"option 'repetition_penalty': expected number, got string \"strong\""),
    gen("stop not a JSON list", ['stop=["a", '], r"stop=\[\"a\", +is not a JSON list of strings, expected a string or "
        r"a JSON list of strings"),
    gen("stop list holding a number", ['stop=["a", 3]'], r"stop: item 2 is 3, expected a non-empty string"),
    gen("stop list holding an empty string", ['stop=[""]'], r"stop: item 1 is empty, expected a non-empty string"),
    gen("eos_ids on the command line", ["eos_ids=1"], r"eos_ids is a list for model:generate in a recipe"),
    recipe("eos_ids not a list", "{ eos_ids = 3 }", r"r\.lua:3: generate: option 'eos_ids': expected a list of token ids, got number"),
    recipe("eos_ids holding a name", '{ eos_ids = { 1, "end" } }',
           r"r\.lua:3: generate: option 'eos_ids': item 2 is not a token id, expected integers >= 0"),
    adapter("adapter folder that is not there", r"no such folder, expected a LoRA adapter folder \(adapter_config\.json "
            r"and adapter_model\.safetensors, as PEFT's save_pretrained and lora:save write\)", lambda d: None),
    adapter("adapter folder without adapter_config.json", r"optim 'lora': a has no adapter_config\.json$",
            lambda d: (d / "a").mkdir()),
    adapter("adapter for a wider model", r"optim 'lora': a/adapter_model\.safetensors: base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight has "
            r"shape \[4, 16\], the model's adapter \[4, 8\], expected an adapter made for this model",
            lambda d: write_adapter(d / "a", hidden=16)),
    adapter("adapter whose rank disagrees with its weights", r"optim 'lora': a/adapter_model\.safetensors: .*lora_A\.weight has rank 2 \(shape \[2, 8\]\), but "
            r"a/adapter_config\.json says r 4, expected the adapter's weights and config to agree",
            lambda d: write_adapter(d / "a", weights_r=2)),
    Case("save_pretrained of a folder whose generation_config.json is not JSON", ["run", "r.lua"],
         r"r\.lua:3: save_pretrained: m/generation_config\.json is not valid JSON: ", setup=broken_generation_config),
    Case("save_pretrained onto a file", ["run", "r.lua"],
         r"r\.lua:3: save_pretrained: out is a file, expected a folder to write \(or a path where none is yet\)",
         setup=out_is_a_file),
]


def tokenizer_recipe(name, body, message, setup=None):
    def make(d):
        if setup:
            setup(d)
        (d / "r.lua").write_text('local wick = require "wick"\n' + body + "\n")
    return Case(name, ["run", "r.lua"], message, setup=make)


CASES += [
    tokenizer_recipe("wick.tokenizer of a path that is not there", 'wick.tokenizer("nope")',
                     r"r\.lua:2: tokenizer: nope: no such file or folder, expected a tokenizer\.json or a folder holding one$"),
    tokenizer_recipe("apply_chat_template option of the wrong type",
                     'wick.tokenizer("m"):apply_chat_template({ { role = "user", content = "hi" } }, '
                     '{ add_generation_prompt = "yes" })',
                     r"r\.lua:2: apply_chat_template: option 'add_generation_prompt': expected a boolean, got \"yes\"$",
                     setup=chat_folder()),
]
CASES += [
    Case("generation_config.json temperature a string", ["generate", "m", "tokenizer=bytes", "prompt=hi"],
         r"generate: m/generation_config\.json: temperature is \"hot\", expected a number$",
         setup=lambda d: (write_decoder(d / "m"),
                          (d / "m" / "generation_config.json").write_text('{"do_sample": true, "temperature": "hot"}'))),
]
