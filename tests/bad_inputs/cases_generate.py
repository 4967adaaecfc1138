"""`wick generate` and model:generate: every option goes through one schema
(an unknown key, a wrong type, a value out of range is refused by name before
a token is made); a prompt plus max_new_tokens beyond the model's context
(max_position_embeddings) is refused, not generated into positions the model
never learned; a recipe's on_token callback that is not a function, or that
fails, is named. A model folder without a tokenizer.json is refused (its ids
printed as bytes would be text that means nothing), naming the folder, the
tokenizer files it does hold and what to pass, unless tokenizer=bytes says the
model was trained on bytes."""
from harness import Case
from hf_files import write_decoder


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
    gen("top_p zero", ["top_p=0"], r"option 'top_p': expected a value in \(0, 1\], got number 0"),
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
