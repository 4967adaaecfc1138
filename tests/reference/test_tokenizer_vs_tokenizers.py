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
