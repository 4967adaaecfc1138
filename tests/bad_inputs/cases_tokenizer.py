"""tokenizer.json (byte-level BPE) and data `text`'s JSONL lines: what the
tokenizers library refuses (merges of tokens outside the vocabulary, merges
that are not two tokens, ids outside u32, wrong-typed fields) is refused,
naming the file and the key, and so are an empty Replace pattern and
normalizers that multiply the text (naming the step, the document and the
limit); JSONL fields of the wrong type name the line. (Truncation and padding
sections are named in a note and not applied, as transformers does not apply
them: tests/reference/test_tokenizer_vs_tokenizers.py.)"""
import json

from harness import Case
from hf_files import tokenizer_json, write_decoder

TOK = r"tokenizer m/tokenizer\.json: "


def tokenizer(edit):
    def setup(d):
        write_decoder(d / "m")
        j = tokenizer_json()
        edit(j)
        (d / "m" / "tokenizer.json").write_text(json.dumps(j))
    return setup


def gen(name, edit, message):
    return Case(name, ["generate", "m", "max_new_tokens=2"], message, setup=tokenizer(edit))


def jsonl(lines):
    def setup(d):
        (d / "d.jsonl").write_text("".join(l + "\n" for l in lines))
        (d / "r.lua").write_text('local wick = require "wick"\n'
                                 'wick.data("text", { file = "d.jsonl", cache_dir = "none" })\n')
    return setup


def data(name, lines, message):
    return Case(name, ["run", "r.lua"], r"r\.lua:2: .*data 'text': d\.jsonl:" + message, setup=jsonl(lines))


def data_with(edit, lines):
    """d.jsonl's lines read by data `text` with m/tokenizer.json (edited)."""
    def setup(d):
        (d / "m").mkdir()
        j = tokenizer_json()
        edit(j)
        (d / "m" / "tokenizer.json").write_text(json.dumps(j))
        (d / "d.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        (d / "r.lua").write_text('local wick = require "wick"\n'
                                 'wick.data("text", { file = "d.jsonl", tokenizer = "m/tokenizer.json", cache_dir = "none" })\n')
    return setup


def replace_stack(n, a, b):
    return lambda j: j.__setitem__("normalizer", {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": a}, "content": b}] * n})


def append_merge(m):
    return lambda j: j["model"]["merges"].append(m)


def set_vocab(token, value):
    return lambda j: j["model"]["vocab"].__setitem__(token, value)


def set_added(key, value):
    return lambda j: j["added_tokens"][0].__setitem__(key, value)


def set_pre(key, value):
    return lambda j: j["pre_tokenizer"].__setitem__(key, value)


def split_pattern(pattern):
    return lambda j: j.__setitem__("pre_tokenizer", {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": pattern, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]})


CASES = [
    gen("merge of tokens outside the vocabulary", append_merge("x q"),
        TOK + r"model\.merges\[4\] is \"x q\", but 'xq' is not in model\.vocab, expected merges of tokens in the vocabulary"),
    gen("merge of one part", append_merge("abc"), TOK + r"model\.merges\[4\] is \"abc\", expected two tokens separated by one space"),
    gen("merge of three parts", append_merge("h e l"), TOK + r"model\.merges\[4\] is \"h e l\", expected two tokens"),
    gen("merge with two spaces", append_merge("h  e"), TOK + r"model\.merges\[4\] is \"h  e\", expected two tokens"),
    gen("merge as a list of three", append_merge(["h", "e", "l"]), TOK + r"model\.merges\[4\] is .*, expected \"a b\" or \[\"a\", \"b\"\]"),
    gen("merge as a number", append_merge(3), TOK + r"model\.merges\[4\] is 3, expected \"a b\""),
    gen("merges a string", lambda j: j["model"].__setitem__("merges", "h e"), TOK + r"model\.merges is \"h e\", expected a list"),
    gen("negative id", set_vocab("he", -1), TOK + r"model\.vocab\.he is -1, expected an integer from 0 to 4294967295"),
    gen("id of 2^40", set_vocab("he", 2 ** 40), TOK + r"model\.vocab\.he is 1099511627776, expected an integer from 0 to 4294967295"),
    gen("id as a float", set_vocab("he", 3.0), TOK + r"model\.vocab\.he is 3\.0, expected an integer"),
    gen("id as a string", set_vocab("he", "3"), TOK + r"model\.vocab\.he is \"3\", expected an integer"),
    gen("vocab a list", lambda j: j["model"].__setitem__("vocab", ["a"]), TOK + r"model\.vocab is \[\"a\"\], expected an object"),
    gen("added token id negative", set_added("id", -5), TOK + r"added_tokens\[0\]\.id is -5, expected an integer from 0"),
    gen("added token id 2^40", set_added("id", 2 ** 40), TOK + r"added_tokens\[0\]\.id is 1099511627776, expected an integer"),
    gen("added token content a number", set_added("content", 5), TOK + r"added_tokens\[0\]\.content is 5, expected a string"),
    gen("add_prefix_space a string", set_pre("add_prefix_space", "yes"), TOK + r"pre_tokenizer\.add_prefix_space is \"yes\", expected true or false"),
    gen("split regex a number", split_pattern({"Regex": 5}),
        TOK + r"pre_tokenizer\.pretokenizers\[0\]\.pattern\.Regex is 5, expected a string"),
    gen("ignore_merges a string", lambda j: j["model"].__setitem__("ignore_merges", "x"),
        TOK + r"model\.ignore_merges is \"x\", expected true or false"),
    gen("no model", lambda j: j.pop("model"), TOK + r"model is missing, expected an object"),
    # no pre-tokenizer over a byte-level vocabulary: a space it has no token for (tokenizers drops it silently)
    Case("no pre-tokenizer", ["generate", "m", "max_new_tokens=2", "prompt=a b"],
         TOK + r"the text holds ' ' \(U\+0020\), which is not in the vocabulary, and the model has neither "
         r"byte_fallback nor an unk_token to stand for it", setup=tokenizer(lambda j: j.__setitem__("pre_tokenizer", None))),
    gen("Metaspace prepend_scheme unknown", lambda j: j.__setitem__("pre_tokenizer", {
            "type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "sometimes", "split": False}),
        TOK + r"pre_tokenizer\.prepend_scheme is \"sometimes\", expected \"always\", \"first\" or \"never\""),
    gen("Metaspace replacement of two characters", lambda j: j.__setitem__("pre_tokenizer", {
            "type": "Metaspace", "replacement": "__", "prepend_scheme": "first", "split": False}),
        TOK + r"Metaspace's replacement must be one character"),
    gen("unk_token outside the vocabulary", lambda j: j["model"].__setitem__("unk_token", "<nope>"),
        TOK + r"model\.unk_token '<nope>' is not in model\.vocab"),
    gen("template naming an undefined special token", lambda j: j.__setitem__("post_processor", {
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}}),
        TOK + r"post_processor\.single\[0\] is special token '<s>', which post_processor\.special_tokens does not define"),
    gen("template of sequence B", lambda j: j.__setitem__("post_processor", {
            "type": "TemplateProcessing", "single": [{"Sequence": {"id": "B", "type_id": 0}}], "special_tokens": {}}),
        TOK + r"post_processor\.single\[0\] is sequence 'B', expected A"),
    gen("template ids not integers", lambda j: j.__setitem__("post_processor", {
            "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": ["one"], "tokens": ["<s>"]}}}),
        TOK + r"post_processor\.special_tokens\.<s>\.ids is .*expected a list of token ids"),
    Case("tokenizer.json is a folder", ["generate", "m", "max_new_tokens=2"], r"m/tokenizer\.json is a directory, expected a JSON file",
         setup=lambda d: (write_decoder(d / "m"), (d / "m" / "tokenizer.json").mkdir())),
    Case("tokenizer.json is not JSON", ["generate", "m", "max_new_tokens=2"], r"m/tokenizer\.json is not valid JSON: ",
         setup=lambda d: (write_decoder(d / "m"), (d / "m" / "tokenizer.json").write_text('{"model": '))),
    # 16 doublings: 65536 times the text, which the tokenizers library builds for as long as it takes
    Case("Replace normalizers that multiply the text", ["run", "r.lua"],
         r"r\.lua:2: .*data 'text': d\.jsonl:2: tokenizer m/tokenizer\.json: normalizer\.normalizers\[6\] "
         r"\(Replace \"a\" with \"aa\"\) makes a text of 1000 bytes longer than 68096 bytes, the limit on normalized "
         r"text \(64 times the text's size plus 4096 bytes\)",
         setup=data_with(replace_stack(16, "a", "aa"), [{"text": "hello"}, {"text": "a" * 1000}])),
    gen("an empty Replace pattern", lambda j: j.__setitem__("normalizer", {
            "type": "Replace", "pattern": {"String": ""}, "content": "_"}),
        TOK + r"normalizer\.pattern\.String is \"\", expected a non-empty string \(the tokenizers library inserts "
        r"the content at every character boundary"),
    data("completion a number", ['{"prompt": "Q", "completion": 5}'], r"1: completion is 5, expected a string"),
    data("prompt without completion", ['{"text": "a"}', '{"prompt": "Q"}'], r"2: completion is missing, expected a string"),
    data("text a list", ['{"text": ["a"]}'], r"1: text is \[\"a\"\], expected a string"),
    data("input_ids a number", ['{"input_ids": 5}'], r"1: input_ids is 5, expected a list"),
    data("input_id past the vocabulary", ['{"input_ids": [1, 257]}'], r"1: input_ids\[1\] is 257, expected an integer in \[0, 257\)"),
    data("input_id 2^64", ['{"input_ids": [18446744073709551615]}'], r"1: input_ids\[0\] is 18446744073709551615, expected an integer"),
    data("line is a list", ['[1, 2]'], r"1 is \[1,2\], expected a JSON object"),
]
