"""Folders that go back whole, and chats answered as transformers answers them.

A tiny random Qwen2 folder made here, with a byte-level BPE tokenizer trained
here, a ChatML chat template that uses the tokenizer's eos_token and a default
system turn, and a generation_config.json whose eos_token_id is a list (the
end-of-turn token and one the model makes early, so generation stops).

- wick.save_pretrained on the model read from that folder writes a folder
  that transformers loads as the original: the same tokenizer ids, the same
  chat rendering, the same generation config, and generate stopping at its eos.
- `wick generate messages=...` renders the chat through the template, stops at
  the end tokens, skips special tokens, and gives transformers' greedy tokens,
  also with repetition_penalty, with stop strings, with a PEFT adapter and
  with that adapter saved again by wick's lora.
"""
import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.' + eos_token + '\\n' }}"
          "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim"
          " + eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHAT = [{"role": "user", "content": "What does the license say about copies?"},
        {"role": "assistant", "content": "You may copy it. "},
        {"role": "user", "content": "And about changes?"}]

N = 24  # new tokens at most

IDS = """
local wick = require "wick"
local a = wick.args
local tok = wick.tokenizer(a.path)
local f = assert(io.open(a.messages))
local ids = tok:apply_chat_template(f:read("*a"), { add_generation_prompt = true, tokenize = true })
f:close()
local m = wick.model("decoder_lm", { path = a.path })
if a.adapter then wick.optim("lora", {}):load(m, a.adapter) end
local gc = wick.core.json_decode(assert(io.open(a.path .. "/generation_config.json")):read("*a"))
local out = m:generate(ids, { max_new_tokens = a.n, repetition_penalty = a.penalty or 1.0, eos_ids = gc.eos_token_id })
print(table.concat(ids, " "))
print(table.concat(out, " "))
"""


def corpus():
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*"))[:6]:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    return texts or ["the quick brown fox jumps over the lazy dog " * 50]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def greedy(model, ids, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The source folder: model, tokenizer, template, generation config whose
    eos list holds <|im_end|> and the 6th token the model makes greedily."""
    d = tmp_path_factory.mktemp("chat")
    tok = make_tokenizer()
    torch.manual_seed(3)
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, eos_token_id=end, pad_token_id=pad, bos_token_id=pad)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper logits: greedy picks are no near-ties, and no short loop
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    free = greedy(model, ids, eos_token_id=None, pad_token_id=pad)
    # an end token the model reaches: the first that did not come before it, from the 6th on
    stop_at = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i] and t != end)
    model.generation_config.eos_token_id = [end, stop_at]
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = pad
    model.save_pretrained(d / "hf", safe_serialization=True)
    tok.save_pretrained(d / "hf")
    (d / "chat.json").write_text(json.dumps(CHAT))
    return {"dir": d, "tok": tok, "model": model, "ids": ids, "free": free, "stop_at": stop_at, "end": end, "pad": pad}


def test_the_source_folder_is_what_users_bring(folder):
    hf = folder["dir"] / "hf"
    assert (hf / "chat_template.jinja").exists() or "chat_template" in json.loads((hf / "tokenizer_config.json").read_text())
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [folder["end"], folder["stop_at"]]


def test_save_pretrained_writes_a_folder_transformers_loads_as_the_original(folder, tmp_path, run_wick):
    d = folder["dir"]
    (tmp_path / "r.lua").write_text('local wick = require "wick"\n'
                                    'local m = wick.model("decoder_lm", { path = wick.args.src })\n'
                                    'wick.save_pretrained(m, wick.args.out)\n'
                                    'wick.save_pretrained(m, wick.args.out)\n')  # again, over the first
    run_wick("run", tmp_path / "r.lua", f"src={d / 'hf'}", f"out={tmp_path / 'saved'}")
    saved = tmp_path / "saved"
    names = sorted(p.name for p in saved.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names), names
    assert not list(tmp_path.glob("saved.saving-*")), "the staging folder is left behind"
    cfg = json.loads((saved / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["bos_token_id"]) == (folder["end"], folder["pad"], folder["pad"])

    # the tokenizer: the same ids, text and chat rendering
    orig, back = transformers.AutoTokenizer.from_pretrained(d / "hf"), transformers.AutoTokenizer.from_pretrained(saved)
    assert type(back) is type(orig)
    texts = ["Hello world", "Copies of the license <|im_end|> and <|endoftext|>", corpus()[0][:2000]]
    for t in texts:
        assert back(t)["input_ids"] == orig(t)["input_ids"]
        assert back.decode(orig(t)["input_ids"], skip_special_tokens=True) == orig.decode(orig(t)["input_ids"], skip_special_tokens=True)
    for gen_prompt in (False, True):
        assert back.apply_chat_template(CHAT, add_generation_prompt=gen_prompt, tokenize=False) == \
            orig.apply_chat_template(CHAT, add_generation_prompt=gen_prompt, tokenize=False)
    assert back.eos_token == "<|im_end|>" and back.pad_token == "<|endoftext|>"

    # the generation config, its eos list included, and generate stopping at it
    gc = transformers.GenerationConfig.from_pretrained(saved)
    assert gc.eos_token_id == [folder["end"], folder["stop_at"]]
    assert gc.pad_token_id == folder["pad"]
    model = transformers.AutoModelForCausalLM.from_pretrained(saved).float().eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    got = greedy(model, folder["ids"])
    assert got == greedy(folder["model"], folder["ids"])
    assert got[-1] == folder["stop_at"] and len(got) < N, got


def test_save_pretrained_of_a_fresh_model_takes_the_tokenizer_folder_given(folder, tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("decoder_lm", { vocab_size = 400, hidden_size = 16, intermediate_size = 32, layers = 1, heads = 2 })\n'
        'wick.save_pretrained(m, wick.args.out, wick.args.tok)\n')
    run_wick("run", tmp_path / "r.lua", f"out={tmp_path / 'fresh'}", f"tok={folder['dir'] / 'hf'}")
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "fresh")
    assert back.apply_chat_template(CHAT, tokenize=False) == folder["tok"].apply_chat_template(CHAT, tokenize=False)
    # the ids the fresh config lacked, from the tokenizer's special tokens
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "fresh")
    assert (cfg.eos_token_id, cfg.pad_token_id) == (folder["end"], folder["pad"])
    gc = transformers.GenerationConfig.from_pretrained(tmp_path / "fresh")
    assert (gc.eos_token_id, gc.pad_token_id) == (folder["end"], folder["pad"])


def wick_ids(run_wick, tmp_path, path, messages, **kw):
    (tmp_path / "ids.lua").write_text(IDS)
    args = [f"path={path}", f"messages={messages}", f"n={N}"] + [f"{k}={v}" for k, v in kw.items()]
    lines = run_wick("run", tmp_path / "ids.lua", *args).stdout.splitlines()
    return [int(x) for x in lines[0].split()], [int(x) for x in lines[1].split()]


def test_chat_ids_and_greedy_tokens_equal_transformers(folder, tmp_path, run_wick):
    hf = folder["dir"] / "hf"
    prompt, out = wick_ids(run_wick, tmp_path, hf, folder["dir"] / "chat.json")
    assert prompt == folder["ids"]
    want = greedy(folder["model"], folder["ids"])
    assert out == want and want[-1] == folder["stop_at"]
    # with a repetition penalty, as transformers' RepetitionPenaltyLogitsProcessor
    _, out = wick_ids(run_wick, tmp_path, hf, folder["dir"] / "chat.json", penalty=1.7)
    want_p = greedy(folder["model"], folder["ids"], repetition_penalty=1.7)
    assert out == want_p and want_p != want, (out, want_p, want)


def test_wick_generate_answers_the_chat_as_transformers(folder, tmp_path, run_wick):
    hf, tok = folder["dir"] / "hf", folder["tok"]
    want = tok.decode(greedy(folder["model"], folder["ids"]), skip_special_tokens=True)
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}")
    assert p.stdout == want + "\n"
    # inline JSON, and the chat on stdin
    p = run_wick("generate", hf, "messages=" + json.dumps(CHAT), f"max_new_tokens={N}")
    assert p.stdout == want + "\n"
    p = subprocess.run([os.environ.get("WICK", str(Path(__file__).resolve().parents[2] / "build" / "bin" / "wick")), "generate", str(hf), "messages=-", f"max_new_tokens={N}"], input=json.dumps(CHAT),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == want + "\n"
    # special tokens are text only when not skipped: the end token the model wrote is not printed
    free = tok.decode(folder["free"], skip_special_tokens=True)
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}", "eos_id=-1")
    assert p.stdout == free + "\n"
    # repetition_penalty
    want_p = tok.decode(greedy(folder["model"], folder["ids"], repetition_penalty=1.7), skip_special_tokens=True)
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}", "repetition_penalty=1.7")
    assert p.stdout == want_p + "\n"


def test_stop_strings_end_the_text_where_transformers_stops(folder, tmp_path, run_wick):
    hf, tok = folder["dir"] / "hf", folder["tok"]
    free_ids = folder["free"]
    full = tok.decode(free_ids, skip_special_tokens=True)
    # a stop string the 8th token or a later one completes: its text, plain ASCII, not in the text before it
    stop = next(s for i in range(7, len(free_ids)) for s in [tok.decode(free_ids[i:i + 1])]
                if s.isascii() and len(s.strip()) >= 2 and s not in tok.decode(free_ids[:i + 1])[:-len(s)])
    got = greedy(folder["model"], folder["ids"], eos_token_id=None, pad_token_id=folder["pad"], stop_strings=[stop],
                 tokenizer=tok)
    # transformers stops at the token that completes the stop string (and keeps it); wick writes the text before it
    assert stop in tok.decode(got, skip_special_tokens=True)
    assert stop not in tok.decode(got[:-1], skip_special_tokens=True)
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}", "eos_id=-1",
                 f"stop={json.dumps([stop, 'never-made'])}")
    assert p.stdout == full[:full.index(stop)] + "\n"


def test_adapter_from_peft_and_from_wick_lora_gives_peft_tokens(folder, tmp_path, run_wick):
    hf, tok = folder["dir"] / "hf", folder["tok"]
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(base, lcfg).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(8.0)  # an adapter that changes the answer
    pm.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([folder["ids"]]), max_new_tokens=N, do_sample=False)[0, len(folder["ids"]):].tolist()
    assert want != greedy(folder["model"], folder["ids"])
    _, out = wick_ids(run_wick, tmp_path, hf, folder["dir"] / "chat.json", adapter=tmp_path / "adapter")
    assert out == want
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}",
                 f"adapter={tmp_path / 'adapter'}")
    assert p.stdout == tok.decode(want, skip_special_tokens=True) + "\n"
    # the same adapter saved again by wick's lora
    (tmp_path / "resave.lua").write_text('local wick = require "wick"\n'
                                         'local m = wick.model("decoder_lm", { path = wick.args.path })\n'
                                         'local l = wick.optim("lora", {})\n'
                                         'l:load(m, wick.args.adapter)\n'
                                         'l:save(m, wick.args.out)\n')
    run_wick("run", tmp_path / "resave.lua", f"path={hf}", f"adapter={tmp_path / 'adapter'}", f"out={tmp_path / 'wl'}")
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}", f"adapter={tmp_path / 'wl'}")
    assert p.stdout == tok.decode(want, skip_special_tokens=True) + "\n"


def test_the_folders_generation_config_sets_the_repetition_penalty_as_in_transformers(folder, tmp_path, run_wick):
    """transformers' generate takes repetition_penalty from generation_config.json; so does wick generate (and
    says so on stderr), and a command-line key replaces it."""
    import shutil
    hf, tok = tmp_path / "hf", folder["tok"]
    shutil.copytree(folder["dir"] / "hf", hf)
    gc = json.loads((hf / "generation_config.json").read_text())
    gc["repetition_penalty"] = 1.7
    (hf / "generation_config.json").write_text(json.dumps(gc))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    want = greedy(model, folder["ids"])  # the folder's penalty, as transformers applies it
    assert want == greedy(folder["model"], folder["ids"], repetition_penalty=1.7)
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}")
    assert p.stdout == tok.decode(want, skip_special_tokens=True) + "\n"
    assert "repetition_penalty 1.7 (a command-line key replaces each)" in p.stderr
    p = run_wick("generate", hf, f"messages={folder['dir'] / 'chat.json'}", f"max_new_tokens={N}", "repetition_penalty=1")
    assert p.stdout == tok.decode(greedy(folder["model"], folder["ids"]), skip_special_tokens=True) + "\n"
