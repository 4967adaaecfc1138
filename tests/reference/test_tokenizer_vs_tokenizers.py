"""Byte-level BPE from tokenizer.json: wick's token ids equal the tokenizers
library's on more than 100 KB of multilingual text (the license texts every
Debian machine carries plus non-ASCII text), special tokens included, and
decoding gives the text back."""
import glob
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")

MULTILINGUAL = [
    "Grüße aus Köln: Übermäßige Straßenbahnfahrten sind größtenteils günstig.",
    "Ελληνικά: Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
    "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "中文：敏捷的棕色狐狸跳过了懒狗。训练大型语言模型需要很多显存。",
    "日本語：いろはにほへと ちりぬるを わかよたれそ つねならむ。",
    "العربية: نص عربي قصير للاختبار مع أرقام ١٢٣ و 456.",
    "Emoji 🙂🚀👩‍💻 and combining: e\u0301 vs é, Å vs A\u030a; numbers 3.14159, 1,000,000!",
    "Code: for (int i = 0; i < n; ++i) { x += y[i] * 2; }  \ttabs\tand   spaces\n\n\nnewlines",
]


def corpus():
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    texts += MULTILINGUAL * 20
    return texts


def build(style, texts):
    tok = Tokenizer(models.BPE())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # qwen2: NFC, its split regex, then bytes
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


RECIPE = """
local wick = require "wick"
local data = wick.data("text", { files = { wick.args.probe }, tokenizer = wick.args.tokenizer })
local out = {}
local f = assert(io.open(wick.args.docs))
local docs = wick.core.json_decode(f:read("*a"))
f:close()
for i, text in ipairs(docs) do
  local ids = data:encode(text)
  out[i] = { ids = ids, text = data:decode(ids) }
end
wick.core.write_file(wick.args.result, wick.json(out))
"""


@pytest.mark.parametrize("style", ["gpt2", "qwen2"])
def test_ids_equal_the_tokenizers_library(tmp_path, run_wick, style):
    texts = corpus()
    assert sum(len(t.encode()) for t in texts) > 100_000
    tok = build(style, texts)
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = texts + ["<|im_start|>user\nHallo Welt 🙂<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<|endoftext|>"]
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    (tmp_path / "probe.txt").write_text("x")
    (tmp_path / "r.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "r.lua", f"tokenizer={tmp_path / 'tokenizer.json'}", f"docs={tmp_path / 'docs.json'}",
             f"probe={tmp_path / 'probe.txt'}", f"result={tmp_path / 'out.json'}")
    got = json.loads((tmp_path / "out.json").read_text())
    total = 0
    for text, g in zip(docs, got):
        want = tok.encode(text).ids
        ids = g["ids"] if isinstance(g["ids"], list) else []
        assert ids == want, (text[:80], ids[:20], want[:20])
        total += len(want)
        normalized = tok.decode(want, skip_special_tokens=False)
        assert g["text"] == normalized
    assert total > 20_000


def _small(tmp_path):
    """A small trained byte-level BPE as JSON, and texts to encode."""
    texts = MULTILINGUAL * 4
    return json.loads(build("gpt2", texts).to_str()), texts + ["hello world", "aaa bbb  ccc", ""]


def _encode_with_wick(tmp_path, run_wick, j, docs, check=True):
    (tmp_path / "tokenizer.json").write_text(json.dumps(j))
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    (tmp_path / "probe.txt").write_text("x")
    (tmp_path / "r.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "r.lua", f"tokenizer={tmp_path / 'tokenizer.json'}", f"docs={tmp_path / 'docs.json'}",
                 f"probe={tmp_path / 'probe.txt'}", f"result={tmp_path / 'out.json'}", check=check)
    if not check:
        return p
    return [g["ids"] if isinstance(g["ids"], list) else [] for g in json.loads((tmp_path / "out.json").read_text())]


def _split(regex):
    def edit(j):
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    return edit


def _empty_added(j):
    j["added_tokens"][0]["content"] = ""


def _merges_twice_as_lists(j):
    j["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in j["model"]["merges"]]
    j["model"]["merges"] += j["model"]["merges"][:5]


ACCEPTED = {
    "an empty split regex": _split(""),
    "a split with empty and non-empty matches": _split(r"(?=a)|b*"),
    "a split whose matches may be empty": _split(r"a*"),
    "a lookahead-only split": _split(r"(?=\s)"),
    "an empty added token": _empty_added,
    "merges as lists, some given twice": _merges_twice_as_lists,
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_what_tokenizers_reads_wick_encodes_the_same(tmp_path, run_wick, name):
    j, texts = _small(tmp_path)
    ACCEPTED[name](j)
    want = [Tokenizer.from_str(json.dumps(j)).encode(t).ids for t in texts]
    assert _encode_with_wick(tmp_path, run_wick, j, texts) == want


def _merge(m):
    return lambda j: j["model"]["merges"].append(m)


def _vocab(value):
    return lambda j: j["model"]["vocab"].__setitem__(next(iter(j["model"]["vocab"])), value)


REFUSED = {
    "a merge of tokens outside the vocabulary": (_merge("q x"), r"model\.merges\[\d+\] is \"q x\", but 'qx' is not in model\.vocab"),
    "a merge of one part": (_merge("abc"), r"model\.merges\[\d+\] is \"abc\", expected two tokens separated by one space"),
    "a merge of three parts": (_merge("a b c"), r"expected two tokens separated by one space"),
    "a merge of three parts as a list": (_merge(["a", "b", "c"]), r"expected \"a b\" or \[\"a\", \"b\"\]"),
    "a negative id": (_vocab(-1), r"model\.vocab\..* is -1, expected an integer from 0 to 4294967295"),
    "an id of 2^40": (_vocab(2 ** 40), r"is 1099511627776, expected an integer from 0 to 4294967295"),
    "an id as a float": (_vocab(3.0), r"is 3\.0, expected an integer"),
    "an added id of -1": (lambda j: j["added_tokens"][0].__setitem__("id", -1), r"added_tokens\[0\]\.id is -1"),
    "a non-boolean flag": (lambda j: j["pre_tokenizer"].__setitem__("add_prefix_space", "no"),
                           r"pre_tokenizer\.add_prefix_space is \"no\", expected true or false"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_tokenizers_refuses_wick_refuses_naming_the_key(tmp_path, run_wick, name):
    import re
    j, texts = _small(tmp_path)
    edit, message = REFUSED[name]
    edit(j)
    with pytest.raises(Exception):
        Tokenizer.from_str(json.dumps(j))
    p = _encode_with_wick(tmp_path, run_wick, j, texts, check=False)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("wick: error:") and "tokenizer.json" in last and re.search(message, last), last
