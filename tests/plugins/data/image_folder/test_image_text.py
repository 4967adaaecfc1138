"""image_folder's text column as tokens: input_ids are the tokenizer's ids of
prompt, text and the end of text; labels mask exactly the prompt and the
padding; a batch pads every row to its longest; a Hugging Face tokenizer.json
gives the same ids as the tokenizers library; a bad tokenizer is a clear
error."""
import csv
import json
import subprocess

import pytest
from safetensors.numpy import load_file

from conftest import WICK

PROMPT = "<image>What is it? "


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    subprocess.run([WICK, "make-clips", d, "--classes", "3", "--per-class", "4", "--no-extras", "--size", "64x48"],
                   check=True, capture_output=True, timeout=600)
    with open(d / "images" / "manifest.csv") as f:
        rows = list(csv.DictReader(f))
    return d / "images" / "manifest.csv", rows


def run_lua(tmp_path, body, check=True):
    recipe = tmp_path / "r.lua"
    recipe.write_text('local wick = require "wick"\n' + body)
    p = subprocess.run([WICK, "run", recipe], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(p.stderr)
    return p


def byte_ids(s):
    """The bytes tokenizer with <image> = 257."""
    out, i = [], 0
    b = s.encode()
    while i < len(b):
        if b[i:i + 7] == b"<image>":
            out.append(257)
            i += 7
        else:
            out.append(b[i])
            i += 1
    return out


def window(tmp_path, manifest, opts, first, count):
    out = tmp_path / "w.safetensors"
    run_lua(tmp_path, f"""
local d = wick.data("image_folder", {{ manifest = "{manifest}", image_size = 32, {opts} }})
print(d.vocab_size, d.eos_id, d.image_token_id)
d:window({first}, {count}):save("{out}")
""")
    return load_file(out)


def test_bytes_ids_labels_and_padding(tmp_path, images):
    manifest, rows = images
    n = 4
    w = window(tmp_path, manifest, f'tokenizer = "bytes", prompt = "{PROMPT}"', 0, n)
    ids, labels, mask = w["0.input_ids"], w["0.labels"], w["0.attention_mask"]
    assert ids.dtype.name == "int64" and labels.dtype.name == "int64" and mask.dtype.name == "int64"
    want = [byte_ids(PROMPT) + byte_ids(r["text"]) + [256] for r in rows[:n]]
    T = max(map(len, want))
    assert ids.shape == (n, T) and w["0.image"].shape == (n, 3, 32, 32)
    assert len(set(map(len, want))) > 1  # the rows differ in length: padding is exercised
    P = len(byte_ids(PROMPT))
    for b, seq in enumerate(want):
        k = len(seq)
        assert list(ids[b, :k]) == seq
        assert all(ids[b, k:] == 256)  # padded with the end of text
        assert list(mask[b]) == [1] * k + [0] * (T - k)
        assert all(labels[b, :P] == -100)  # the prompt carries no loss
        assert list(labels[b, P:k]) == seq[P:]  # the caption and its end do
        assert all(labels[b, k:] == -100)  # nor does padding
    assert (ids == 257).sum(axis=1).tolist() == [1] * n


def test_text_length_truncates(tmp_path, images):
    manifest, rows = images
    w = window(tmp_path, manifest, f'tokenizer = "bytes", prompt = "{PROMPT}", text_length = 24', 0, 2)
    assert w["0.input_ids"].shape == (2, 24)
    assert list(w["0.input_ids"][0]) == (byte_ids(PROMPT) + byte_ids(rows[0]["text"]) + [256])[:24]


def test_pad_to_multiple_of_rounds_the_batch_up_within_text_length(tmp_path, images):
    manifest, rows = images
    n = 4
    want = [byte_ids(PROMPT) + byte_ids(r["text"]) + [256] for r in rows[:n]]
    T = max(map(len, want))
    w = window(tmp_path, manifest, f'tokenizer = "bytes", prompt = "{PROMPT}", pad_to_multiple_of = 16', 0, n)
    ids, labels, mask = w["0.input_ids"], w["0.labels"], w["0.attention_mask"]
    R = (T + 15) // 16 * 16
    assert R > T and ids.shape == labels.shape == mask.shape == (n, R)
    for b, seq in enumerate(want):
        k = len(seq)
        assert list(ids[b, :k]) == seq and all(ids[b, k:] == 256)
        assert list(mask[b]) == [1] * k + [0] * (R - k) and all(labels[b, k:] == -100)
    # text_length caps it: the rounded length stops there
    w = window(tmp_path, manifest, f'tokenizer = "bytes", prompt = "{PROMPT}", pad_to_multiple_of = 64, '
               f'text_length = {T + 1}', 0, n)
    assert w["0.input_ids"].shape == (n, T + 1)
    for bad in ["0", "2.5", '"8"']:
        p = run_lua(tmp_path, f'wick.data("image_folder", {{ manifest = "{manifest}", image_size = 32, '
                              f'tokenizer = "bytes", pad_to_multiple_of = {bad} }})', check=False)
        assert p.returncode != 0 and "pad_to_multiple_of" in p.stderr, p.stderr


def test_no_tokenizer_no_text(tmp_path, images):
    manifest, _ = images
    out = tmp_path / "w.safetensors"
    run_lua(tmp_path, f"""
local d = wick.data("image_folder", {{ manifest = "{manifest}", image_size = 32 }})
d:window(0, 2):save("{out}")
""")
    assert set(load_file(out)) == {"0.image", "0.label", "0.index"}


def test_tokenizer_json_matches_tokenizers(tmp_path, images):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    manifest, rows = images
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([r["text"] for r in rows] * 5 + [PROMPT] * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    w = window(tmp_path, manifest, f'tokenizer = "{path}", prompt = "{PROMPT}"', 0, 3)
    eos = tok.token_to_id("<|endoftext|>")
    P = tok.encode(PROMPT).ids
    assert tok.token_to_id("<image>") in P
    for b in range(3):
        seq = P + tok.encode(rows[b]["text"]).ids + [eos]
        assert list(w["0.input_ids"][b, :len(seq)]) == seq
        assert list(w["0.labels"][b, :len(P)]) == [-100] * len(P)


def test_bad_tokenizer_is_a_clear_error(tmp_path, images):
    manifest, _ = images
    p = run_lua(tmp_path, f"""
wick.data("image_folder", {{ manifest = "{manifest}", tokenizer = "{tmp_path}/missing/tokenizer.json" }})
""", check=False)
    assert p.returncode != 0
    assert "image_folder" in p.stderr and "missing/tokenizer.json" in p.stderr and "Traceback" not in p.stderr
    # a tokenizer.json without the image token the prompt needs
    bad = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a red circle"], trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(bad))
    p = run_lua(tmp_path, f"""
wick.data("image_folder", {{ manifest = "{manifest}", tokenizer = "{bad}", prompt = "<image> x" }})
""", check=False)
    assert p.returncode != 0 and "<image>" in p.stderr and "image_folder" in p.stderr


def test_video_text_pairs(tmp_path, images):
    """video_folder takes the same text columns: the clips of the top-level
    manifest (path, label, text) with their captions as tokens, beside the frames."""
    manifest, _ = images
    videos = manifest.parent.parent / "manifest.csv"
    with open(videos) as f:
        rows = list(csv.DictReader(f))
    out = tmp_path / "w.safetensors"
    run_lua(tmp_path, f"""
local d = wick.data("video_folder", {{ manifest = "{videos}", max_frames = 4, image_size = 32, tokenizer = "bytes",
  prompt = "{PROMPT}" }})
assert(d.image_token_id == 257 and d.eos_id == 256 and d.vocab_size == 258)
d:window(0, 3):save("{out}")
""")
    w = load_file(out)
    assert w["0.video"].shape == (3, 4, 3, 32, 32)
    P = len(byte_ids(PROMPT))
    for b in range(3):
        seq = byte_ids(PROMPT) + byte_ids(rows[b]["text"]) + [256]
        assert "moving" in rows[b]["text"]  # a video's caption, not an image's
        assert list(w["0.input_ids"][b, :len(seq)]) == seq
        assert all(w["0.labels"][b, :P] == -100) and list(w["0.labels"][b, P:len(seq)]) == seq[P:]
