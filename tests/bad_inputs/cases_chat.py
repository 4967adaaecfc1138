"""Chat data: conversational rows of data `text` and wick.tokenizer's
apply_chat_template. A conversation that is no list of messages, a message
without a role or with content of the wrong type, a template that raises
(its message, the template's file and the row), a folder without a chat
template, and a bytes tokenizer are each named."""
import json

from harness import Case
from hf_files import tokenizer_json

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
          "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
USER = {"role": "user", "content": "hello"}
ASSISTANT = {"role": "assistant", "content": "well"}

DATA = ('local wick = require "wick"\n'
        'wick.data("text", { file = "d.jsonl", tokenizer = "m", cache_dir = "none" })\n')


def folder(d, template=CHATML, config=True):
    (d / "m").mkdir()
    (d / "m" / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    if config:
        cfg = {"eos_token": "<|endoftext|>"}
        if template is not None:
            cfg["chat_template"] = template
        (d / "m" / "tokenizer_config.json").write_text(json.dumps(cfg))


def rows(*records, template=CHATML, recipe=DATA):
    def setup(d):
        folder(d, template)
        (d / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (d / "r.lua").write_text(recipe)
    return setup


def data(name, records, message, **kw):
    return Case(name, ["run", "r.lua"], r"r\.lua:2: .*data 'text': d\.jsonl:" + message, setup=rows(*records, **kw))


def api(name, call, message, template=CHATML):
    def setup(d):
        folder(d, template)
        (d / "r.lua").write_text('local wick = require "wick"\nlocal tok = wick.tokenizer("m")\n' + call + "\n")
    return Case(name, ["run", "r.lua"], r"r\.lua:3: " + message, setup=setup)


CASES = [
    data("messages not a list", [{"messages": "hello"}],
         r"1: messages is \"hello\", expected a list of messages \(\{\"role\": \.\.\., \"content\": \.\.\.\}\)$"),
    data("a message not an object", [{"messages": [USER, 7]}], r"1: messages\[1\] is 7, expected a message"),
    data("a message without a role", [{"messages": [USER, {"content": "hi"}]}],
         r"1: messages\[1\]\.role is missing, expected a string \(\"system\", \"user\", \"assistant\", \.\.\.\)$"),
    data("content a number", [{"messages": [USER, ASSISTANT]}, {"messages": [{"role": "user", "content": 42}]}],
         r"2: messages\[0\]\.content is 42, expected a string \(or a list of parts"),
    data("an empty conversation", [{"messages": []}], r"1: messages is an empty list, expected at least one message$"),
    data("prompt a list, completion a string", [{"prompt": [USER], "completion": "well"}],
         r"1: completion is \"well\", expected a list of messages, as the prompt is one"),
    data("tools not a list", [{"messages": [USER, ASSISTANT], "tools": "weather"}],
         r"1: tools is \"weather\", expected a list of tool schemas \(or null\)$"),
    data("the template raises", [{"messages": [USER, ASSISTANT]}, {"messages": [{"role": "system", "content": "x"}, USER]}],
         r"2: the chat template m/tokenizer_config\.json \(line 1\) failed: Only user and assistant roles are "
         r"supported!$", template=STRICT),
    Case("a folder without a chat template", ["run", "r.lua"],
         r"r\.lua:2: .*data 'text': d\.jsonl:1: a conversation needs a chat template, and the tokenizer folder m has "
         r"none: expected chat_template\.jinja or a \"chat_template\" in tokenizer_config\.json there",
         setup=rows({"messages": [USER, ASSISTANT]}, template=None)),
    Case("messages with the bytes tokenizer", ["run", "r.lua"],
         r"r\.lua:2: .*data 'text': d\.jsonl:1: a conversation needs a chat template, and the tokenizer is 'bytes'",
         setup=rows({"messages": [USER, ASSISTANT]},
                    recipe='local wick = require "wick"\nwick.data("text", { file = "d.jsonl", cache_dir = "none" })\n')),
    Case("a template that does not parse", ["run", "r.lua"],
         r"r\.lua:2: .*the chat template m/tokenizer_config\.json does not parse: ",
         setup=rows({"messages": [USER, ASSISTANT]}, template="{% for m in messages %}{{ m.role }")),
    api("apply_chat_template without a template", "tok:apply_chat_template({ { role = 'user', content = 'x' } })",
        r".*apply_chat_template: the tokenizer m/tokenizer\.json has no chat template \(no chat_template\.jinja, and no "
        r"chat_template in tokenizer_config\.json in m\), expected a chat model's tokenizer folder", template=None),
    api("apply_chat_template content a table", "tok:apply_chat_template({ { role = 'user', content = { a = 1 } } })",
        r".*apply_chat_template: messages\[0\]\.content: expected a string or a list of parts, got an object"),
    api("apply_chat_template tokenize a string", "tok:apply_chat_template({ { role = 'user', content = 'x' } }, "
        "{ tokenize = 'yes' })", r".*apply_chat_template: option 'tokenize': expected a boolean, got \"yes\""),
    # transformers' continue_final_message, return_dict and return_assistant_tokens_mask: what it refuses, refused
    api("continue_final_message a number", "tok:apply_chat_template({ { role = 'user', content = 'x' } }, "
        "{ continue_final_message = 3 })",
        r".*apply_chat_template: option 'continue_final_message': expected a boolean or the name of the final "
        r"message's field to continue \(content, reasoning_content, \.\.\.\), got 3"),
    api("continue_final_message with add_generation_prompt", "tok:apply_chat_template({ { role = 'user', "
        "content = 'x' } }, { continue_final_message = true, add_generation_prompt = true })",
        r".*apply_chat_template: continue_final_message and add_generation_prompt are both set, expected one"),
    api("continue_final_message of a field the template never reads", "tok:apply_chat_template({ { role = "
        "'assistant', content = 'x', notes = 'y' } }, { continue_final_message = 'notes' })",
        r".*apply_chat_template: continue_final_message is \"notes\", which the chat template does not read, "
        r"expected a field it renders"),
    api("continue_final_message with the mask", "tok:apply_chat_template({ { role = 'user', content = 'x' } }, "
        "{ continue_final_message = true, return_assistant_tokens_mask = true })",
        r".*apply_chat_template: continue_final_message and return_assistant_tokens_mask are both set"),
    api("return_assistant_tokens_mask without tokenize", "tok:apply_chat_template({ { role = 'user', content = 'x' } "
        "}, { return_assistant_tokens_mask = true, tokenize = false })",
        r".*apply_chat_template: return_assistant_tokens_mask = true needs tokenize = true and return_dict = true "
        r"\(a table of input_ids, attention_mask and assistant_masks\), got tokenize = false"),
    api("return_dict a string", "tok:apply_chat_template({ { role = 'user', content = 'x' } }, "
        "{ return_dict = 'yes' })", r".*apply_chat_template: option 'return_dict': expected a boolean, got \"yes\""),
    Case("a data set's apply_chat_template asked for the mask", ["run", "r.lua"],
         r"r\.lua:3: .*apply_chat_template: option 'return_assistant_tokens_mask' is wick\.tokenizer's \(a data set's "
         r"apply_chat_template gives the text or its ids\), expected wick\.tokenizer\(folder\):apply_chat_template",
         setup=lambda d: (folder(d), (d / "r.lua").write_text(
             'local wick = require "wick"\nlocal data = wick.data("text", { tokenizer = "m" })\n'
             "data:apply_chat_template({ { role = 'user', content = 'x' } }, { return_assistant_tokens_mask = true })\n"))),
    api("encode with an unknown option", "tok:encode('x', { add_bos = true })",
        r".*encode: unknown option 'add_bos' \(expected add_special_tokens\)"),
    Case("wick.tokenizer of a folder without tokenizer.json", ["run", "r.lua"],
         r"r\.lua:2: .*tokenizer: the folder m has no tokenizer\.json, expected a folder holding the tokenizer\.json "
         r"that Hugging Face's tokenizers library saves, or that file itself",
         setup=lambda d: ((d / "m").mkdir(), (d / "r.lua").write_text('local wick = require "wick"\n'
                                                                      'local tok = wick.tokenizer("m")\n'))),
]
