"""BPE from tokenizer.json: wick's token ids equal the tokenizers library's on
more than 100 KB of multilingual text (the license texts every Debian machine
carries, and over 100 KB of non-ASCII text from the translated messages of 14
languages' gettext catalogs), special tokens included, and decoding gives
what the library's decoders give: byte-level (GPT-2, Qwen2, LLaMA-3 with its
BOS template and ignore_merges) and with byte fallback (LLaMA-2 and LLaVA-1.5's
Prepend/Replace normalizers, Mistral's Metaspace), with added tokens'
lstrip, rstrip, single_word and normalized flags; and on one-line documents
of hundreds of KB, which wick once encoded in quadratic time."""
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


LANGUAGES = ["de", "fr", "ru", "uk", "el", "ja", "zh_CN", "ko", "ar", "he", "hi", "th", "vi", "pl"]


def translations(per_language=12_000):
    """Real text in 14 languages and scripts: the translated messages of the
    gettext catalogs the machine's Debian packages install, the first
    `per_language` bytes of each language's (files and messages in sorted
    order, so every run reads the same)."""
    import gettext
    texts = []
    for lang in LANGUAGES:
        got = []
        size = 0
        for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            try:
                with open(path, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog
            except (OSError, UnicodeDecodeError):
                continue
            for key in sorted(k for k in catalog if isinstance(k, str) and k):
                msg = catalog[key]
                if isinstance(msg, str) and msg.strip() and size < per_language:
                    got.append(msg)
                    size += len(msg.encode())
            if size >= per_language:
                break
        texts.append("\n".join(got))
    return texts


def corpus():
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    texts += MULTILINGUAL * 20
    texts += translations()
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


def encode_decode_with_wick(tmp_path, run_wick, docs):
    """wick's ids and decoded text of each doc, with tmp_path/tokenizer.json."""
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    (tmp_path / "probe.txt").write_text("x")
    (tmp_path / "r.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "r.lua", f"tokenizer={tmp_path / 'tokenizer.json'}", f"docs={tmp_path / 'docs.json'}",
             f"probe={tmp_path / 'probe.txt'}", f"result={tmp_path / 'out.json'}")
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("style", ["gpt2", "qwen2"])
def test_ids_equal_the_tokenizers_library(tmp_path, run_wick, style):
    texts = corpus()
    assert sum(len(t.encode()) for t in texts) > 100_000
    # of it, over 100 KB in scripts other than Latin's ASCII (14 languages' translated messages)
    assert sum(len(t.encode()) - len(t.encode("ascii", "ignore")) for t in texts) > 100_000
    tok = build(style, texts)
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = texts + ["<|im_start|>user\nHallo Welt 🙂<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<|endoftext|>"]
    got = encode_decode_with_wick(tmp_path, run_wick, docs)
    total = 0
    for text, g in zip(docs, got):
        want = tok.encode(text).ids
        ids = g["ids"] if isinstance(g["ids"], list) else []
        assert ids == want, (text[:80], ids[:20], want[:20])
        total += len(want)
        normalized = tok.decode(want, skip_special_tokens=False)
        assert g["text"] == normalized
    assert total > 20_000


SP = "\u2581"  # SentencePiece's space
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
TEMPLATE_BOS = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}


def added(content, id, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False):
    return {"id": id, "content": content, "single_word": single_word, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def build_byte_fallback(style, texts):
    """A tokenizer.json of the LLaMA-2 / LLaVA-1.5 kind ("llama2": Prepend and
    Replace normalizers, no pre-tokenizer, so each text between added tokens is
    one word) or of Mistral's ("mistral": a Metaspace pre-tokenizer that
    prepends to the input's first part only): BPE over characters with the 256
    byte tokens after <unk>, <s>, </s>, byte fallback for characters outside
    its 200-character alphabet, fused unknowns, a BOS template, and added
    tokens with each flag."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first", split=True)  # to train on words
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=3000, limit_alphabet=200,
                                                       special_tokens=["<unk>", "<s>", "</s>"]))
    j = json.loads(tok.to_str())
    order = sorted(j["model"]["vocab"], key=j["model"]["vocab"].get)
    vocab = {t: i for i, t in enumerate(order[:3] + BYTE_TOKENS + [t for t in order[3:] if t not in BYTE_TOKENS])}
    n = len(vocab)
    j["model"]["vocab"] = vocab
    j["added_tokens"] = [added("<unk>", 0), added("<s>", 1), added("</s>", 2), added("<image>", n),
                         added("[SEP]", n + 1, special=False, lstrip=True, rstrip=True),
                         added("cat", n + 2, special=False, normalized=True, single_word=True)]
    j["post_processor"] = TEMPLATE_BOS
    if style == "llama2":
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP}, {"type": "Replace", "pattern": {"String": " "}, "content": SP}]}
        j["pre_tokenizer"] = None
        j["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    else:
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": SP, "prepend_scheme": "first", "split": False}
        j["decoder"] = {"type": "Metaspace", "replacement": SP, "prepend_scheme": "first", "split": False}
    return Tokenizer.from_str(json.dumps(j))


def build_llama3(texts):
    """LLaMA-3's kind: byte-level with a split regex, ignore_merges, and a
    post-processor adding <|begin_of_text|>."""
    tok = build("qwen2", texts)
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    bos = len(j["model"]["vocab"])
    j["added_tokens"].append(added("<|begin_of_text|>", bos))
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                                  {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}}]}
    return Tokenizer.from_str(json.dumps(j))


TRICKY = ["<s>[INST] What is in the <image>? [/INST] A cat.</s>",
          "the cat sat on the category of cats; cat", "x [SEP] y  [SEP]z", " leading space and  two", "",
          "<image>\n<image>describe", "\u00e9\u0301 \U0001F680\U0001F680 \u2603 \u4e2d\u6587 \u0915\u093f\u0924\u093e\u092c",
          "trailing spaces   ", "\n\nnewlines\n", "tabs\tand\u3000ideographic space"]


@pytest.mark.parametrize("style", ["llama2", "mistral", "llama3"])
def test_ids_of_the_tokenizers_users_bring_equal_the_tokenizers_library(tmp_path, run_wick, style):
    texts = corpus()
    tok = build_llama3(texts) if style == "llama3" else build_byte_fallback(style, texts)
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = texts + TRICKY
    got = encode_decode_with_wick(tmp_path, run_wick, docs)
    total, fallback = 0, 0
    byte_ids = {tok.token_to_id(b) for b in BYTE_TOKENS} - {None}
    for text, g in zip(docs, got):
        want = tok.encode(text).ids
        ids = g["ids"] if isinstance(g["ids"], list) else []
        assert ids == want, (text[:80], ids[:20], want[:20])
        total += len(want)
        fallback += sum(i in byte_ids for i in want)
        assert g["text"] == tok.decode(want, skip_special_tokens=False), text[:80]
    assert total > 20_000
    assert want[0] == tok.token_to_id("<|begin_of_text|>" if style == "llama3" else "<s>")  # the template's BOS
    if style != "llama3":
        assert fallback > 100  # characters outside the alphabet went through their bytes


def long_lines(texts):
    """One-line documents of hundreds of KB, where encoding time once grew
    with the square of the length (issue 33): the corpus as one line, a
    megabyte of words, half a megabyte of spaces (Replace and Metaspace put
    U+2581 for each), and chat turns between added tokens."""
    return [" ".join(t.replace("\n", " ") for t in texts), "word " * 200_000, " " * 500_000,
            "<|im_start|>user\nHallo Welt<|im_end|>\n" * 10_000]


@pytest.mark.parametrize("style", ["gpt2", "qwen2", "llama2", "mistral", "llama3"])
def test_ids_of_long_lines_equal_the_tokenizers_library(tmp_path, run_wick, style):
    texts = corpus()
    tok = (build(style, texts) if style in ("gpt2", "qwen2") else build_llama3(texts) if style == "llama3"
           else build_byte_fallback(style, texts))
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = long_lines(texts)
    assert min(len(d.encode()) for d in docs) > 300_000
    got = encode_decode_with_wick(tmp_path, run_wick, docs)
    for text, g in zip(docs, got):
        want = tok.encode(text).ids
        ids = g["ids"] if isinstance(g["ids"], list) else []
        assert len(ids) == len(want) and ids == want, (text[:40], len(ids), len(want))


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


def _set(key, value):
    return lambda j: j.__setitem__(key, value)


# What the tokenizers library reads but wick does not run: refused by name, never tokenized another way.
UNSUPPORTED = {
    "BPE dropout": (lambda j: j["model"].__setitem__("dropout", 0.1), r"uses BPE dropout, which wick does not support"),
    "a regex Replace normalizer": (_set("normalizer", {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
                                   r"uses a Replace normalizer with a regex pattern"),
    "a Lowercase normalizer": (_set("normalizer", {"type": "Lowercase"}), r"uses normalizer Lowercase"),
    "BertProcessing": (_set("post_processor", {"type": "BertProcessing", "sep": ["[SEP]", 1], "cls": ["[CLS]", 0]}),
                       r"uses post-processor BertProcessing"),
    "a template without the sequence": (
        _set("post_processor", dict(TEMPLATE_BOS, single=[{"SpecialToken": {"id": "<s>", "type_id": 0}}])),
        r"post_processor\.single has no Sequence A"),
    "a Whitespace pre-tokenizer": (_set("pre_tokenizer", {"type": "Whitespace"}), r"uses pre-tokenizer Whitespace"),
    "a template with a token after the sequence": (
        _set("post_processor", dict(TEMPLATE_BOS, single=[{"Sequence": {"id": "A", "type_id": 0}},
                                                          {"SpecialToken": {"id": "<s>", "type_id": 0}}])),
        r"uses a post-processor template with tokens after the sequence \(post_processor\.single\[1\]\)"),
    # the library's normalized text is "_G_r_" for "Gr", but its pieces "__", "G", "_", "r", "_"
    "an empty Replace pattern": (_set("normalizer", {"type": "Sequence", "normalizers": [
                                     {"type": "NFC"}, {"type": "Replace", "pattern": {"String": ""}, "content": "_"}]}),
                                 r"normalizer\.normalizers\[1\]\.pattern\.String is \"\", expected a non-empty string"),
    "a CTC decoder": (_set("decoder", {"type": "CTC", "pad_token": "<pad>", "word_delimiter_token": "|", "cleanup": True}),
                      r"uses decoder CTC"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_what_wick_does_not_run_is_refused_by_name(tmp_path, run_wick, name):
    import re
    j, texts = _small(tmp_path)
    j["added_tokens"].append(added("<s>", len(j["model"]["vocab"]) + 10))
    edit, message = UNSUPPORTED[name]
    edit(j)
    Tokenizer.from_str(json.dumps(j))  # the library reads it
    p = _encode_with_wick(tmp_path, run_wick, j, texts, check=False)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("wick: error:") and "tokenizer.json" in last and re.search(message, last), last


@pytest.mark.parametrize("section,value", [
    ("truncation", {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}),
    ("padding", {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "<s>"})])
def test_truncation_and_padding_sections_are_named_and_not_applied_as_transformers_does(tmp_path, run_wick, section,
                                                                                         value):
    from transformers import PreTrainedTokenizerFast
    j, texts = _small(tmp_path)
    j[section] = value
    ids = _encode_with_wick(tmp_path, run_wick, j, texts)
    p = _encode_with_wick(tmp_path, run_wick, j, texts, check=False)
    assert f'its "{section}" section is not applied' in p.stderr, p.stderr
    # transformers' tokenizer(text) on the same file: neither cut to 4 nor padded to 64
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    want = [hf(t)["input_ids"] for t in texts]
    assert any(len(w) > 4 for w in want)
    assert ids == want


DATA_RECIPE = """
local wick = require "wick"
local data = wick.data("text", { file = wick.args.file, tokenizer = wick.args.tokenizer, cache_dir = "none" })
data:window(0, data:size(), 1):save(wick.args.result)
"""


def test_a_data_set_with_a_bos_template_starts_each_document_with_it_and_ends_it_with_eos(tmp_path, run_wick):
    """LLaMA's kind: BOS from the template once, before the prompt (masked)
    or the text, the completion without a second BOS, </s> (the default
    end-of-text token of such a tokenizer) at the end."""
    from safetensors.torch import load_file
    tok = build_byte_fallback("llama2", MULTILINGUAL * 4)
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = [{"text": "Grüße aus Köln"}, {"prompt": "Q: what is 2+2?", "completion": " It is 4."}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "r.lua").write_text(DATA_RECIPE)
    run_wick("run", tmp_path / "r.lua", f"file={tmp_path / 'd.jsonl'}", f"tokenizer={tmp_path / 'tokenizer.json'}",
             f"result={tmp_path / 'w.safetensors'}")
    w = load_file(str(tmp_path / "w.safetensors"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    text = tok.encode(docs[0]["text"]).ids
    assert w["0.input_ids"][0].tolist() == text + [eos] and text[0] == bos and text.count(bos) == 1
    prompt = tok.encode(docs[1]["prompt"]).ids
    completion = tok.encode(docs[1]["completion"], add_special_tokens=False).ids
    assert w["1.input_ids"][0].tolist() == prompt + completion + [eos]
    assert w["1.labels"][0].tolist() == [-100] * len(prompt) + completion + [eos]
