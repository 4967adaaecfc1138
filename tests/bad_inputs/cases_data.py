"""Text data: a document with nothing to learn from (one token, or every label
masked) is skipped, counted and named with its file and line; only a source
with nothing left is an error."""
import json

from harness import Case

RECIPE = """local wick = require 'wick'
local opts = { max_length = 16, cache_dir = 'none' }
if wick.args.file then opts.file = wick.args.file else
  opts.files = {}
  for i = 0, 20 do opts.files[#opts.files + 1] = 'docs/d' .. i .. '.txt' end
end
local data = wick.data('text', opts)
local model = wick.model('decoder_lm', { vocab_size = data.vocab_size, hidden_size = 16, layers = 1, heads = 2,
  intermediate_size = 32 })
local run = wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 1,
  shuffle = false, quiet = true }
print(string.format('%d steps, %d skipped', run.steps, data.skipped_items))
"""


def docs(empty=(0,)):
    """21 plain text documents, those in `empty` with no text (the end-of-text token alone)."""
    def setup(d):
        (d / "recipe.lua").write_text(RECIPE)
        (d / "docs").mkdir()
        for i in range(21):
            (d / "docs" / f"d{i}.txt").write_text("" if i in empty else f"document {i} has a few words\n")
    return setup


def jsonl(*records):
    def setup(d):
        (d / "recipe.lua").write_text(RECIPE)
        (d / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return setup


CASES = [
    Case("a one-token document among 21 is named", ["run", "recipe.lua"],
         r"^wick: data 'text': skipping docs/d0\.txt: 1 token, and a sample needs 2", rc=0, setup=docs()),
    Case("a one-token document among 21 is counted", ["run", "recipe.lua"], r"^20 steps, 1 skipped$", rc=0,
         setup=docs()),
    Case("an empty JSONL text is named by line", ["run", "recipe.lua", "file=d.jsonl"],
         r"^wick: data 'text': skipping d\.jsonl:2: 1 token", rc=0,
         setup=jsonl({"text": "abc"}, {"text": ""}, {"text": "def"})),
    Case("a prompt that fills max_length is named", ["run", "recipe.lua", "file=d.jsonl"],
         r"^wick: data 'text': skipping d\.jsonl:1: every label after the first token is masked", rc=0,
         setup=jsonl({"prompt": "a prompt longer than sixteen bytes", "completion": "x"}, {"text": "abc"})),
    Case("no document left", ["run", "recipe.lua", "file=d.jsonl"],
         r"data 'text': no sample has anything to learn from \(2 skipped; the first: d\.jsonl:1: 1 token",
         setup=jsonl({"text": ""}, {"input_ids": [5]})),
    # a cache_dir that cannot be a folder left every run uncached without a word
    Case("cache_dir names a file", ["run", "c.lua"],
         r"c\.lua:2: .*data 'text': cache_dir tok\.cache is not a folder, expected a folder for the token cache "
         r"\(or 'none': no cache\)",
         setup=lambda d: ((d / "a.txt").write_text("some text\n"), (d / "tok.cache").write_text("x"),
                          (d / "c.lua").write_text("local wick = require 'wick'\n"
                                                   "wick.data('text', { files = { 'a.txt' }, cache_dir = 'tok.cache' })\n"))),
    Case("cache_dir below a file", ["run", "c.lua"],
         r"c\.lua:2: .*data 'text': cache_dir tok\.cache/sub cannot be made: Not a directory, expected a folder",
         setup=lambda d: ((d / "a.txt").write_text("some text\n"), (d / "tok.cache").write_text("x"),
                          (d / "c.lua").write_text("local wick = require 'wick'\n"
                                                   "wick.data('text', { files = { 'a.txt' }, cache_dir = 'tok.cache/sub' })\n"))),
]



# Several files and globs, the eval split, and pack_attention: each bad option named with what was expected.
def text_data(opts, files=("data/a.jsonl", "data/b.jsonl", "more.txt")):
    """c.lua makes data 'text' with `opts` (Lua) on its line 2, beside data/a.jsonl, data/b.jsonl (two rows
    each) and more.txt."""
    def setup(d):
        (d / "data").mkdir()
        for f in files:
            (d / f).write_text('{"text": "one row"}\n{"text": "another row"}\n' if f.endswith(".jsonl") else "text\n")
        (d / "c.lua").write_text("local wick = require 'wick'\n"
                                 "wick.data('text', { cache_dir = 'none', " + opts + " })\n")
    return setup


def text_case(name, opts, message, **kw):
    return Case(name, ["run", "c.lua"], r"c\.lua:2: .*" + message, setup=text_data(opts, **kw))


CASES += [
    text_case("a files pattern that matches nothing", "files = { 'more.txt', 'data/*.parquet' }",
              r"data 'text': files\[2\] 'data/\*\.parquet' matches no file, expected a pattern \(\*, \?, \[\.\.\.\]\) "
              r"that names at least one file"),
    text_case("a files entry that is a folder", "files = { 'data' }",
              r"data 'text': files\[1\] 'data' is a folder, expected a file or a pattern such as 'data/\*\.jsonl'"),
    text_case("a files entry that does not exist", "files = { 'data/c.jsonl' }",
              r"data 'text': files\[1\] 'data/c\.jsonl': no such file, expected a text or JSONL file or a pattern"),
    text_case("an eval_files pattern that matches nothing", "files = { 'data/*.jsonl' }, eval_files = { 'val/*' }",
              r"data 'text': eval_files\[1\] 'val/\*' matches no file"),
    text_case("eval_fraction a string", "files = { 'data/*.jsonl' }, eval_fraction = 'five percent'",
              r"data 'text': option 'eval_fraction': expected number, got string \"five percent\""),
    text_case("eval_fraction negative", "files = { 'data/*.jsonl' }, eval_fraction = -0.05",
              r"data 'text': option 'eval_fraction': expected a value in \[0, 1\], got number -0\.05"),
    text_case("eval_fraction NaN", "files = { 'data/*.jsonl' }, eval_fraction = 0/0", r"data 'text': option 'eval_fraction': expected a finite number, got number nan"),
    text_case("eval_fraction 1", "files = { 'data/*.jsonl' }, eval_fraction = 1",
              r"data 'text': eval_fraction 1 leaves no document to train on, expected a fraction in \[0, 1\)"),
    text_case("eval_fraction above 1", "files = { 'data/*.jsonl' }, eval_fraction = 1.5", r"option 'eval_fraction': expected a value in \[0, 1\], got number 1\.5"),
    text_case("eval_fraction that leaves nothing to train on", "files = { 'data/a.jsonl' }, eval_fraction = 0.6",
              r"data 'text': eval_fraction 0\.6 holds out 2 of the 2 documents, leaving none to train on; expected a "
              r"smaller fraction or more documents"),
    text_case("eval_fraction and eval_files together",
              "files = { 'data/*.jsonl' }, eval_fraction = 0.1, eval_files = { 'more.txt' }",
              r"data 'text': eval_fraction and eval_files are both given, expected one way to hold out"),
    text_case("eval_files that hold every file", "files = { 'data/*.jsonl' }, eval_files = { 'data/*' }",
              r"data 'text': every file is among eval_files, expected files to train on beside them"),
    text_case("split eval without a held-out part", "files = { 'data/*.jsonl' }, split = 'eval'",
              r"data 'text': split = 'eval' without eval_fraction or eval_files, expected one of them"),
    text_case("split an unknown half", "files = { 'data/*.jsonl' }, eval_fraction = 0.1, split = 'test'",
              r"data 'text': option 'split': expected one of train, eval, got string \"test\""),
    text_case("pack_attention unknown", "files = { 'data/*.jsonl' }, pack = true, pack_attention = 'sequence'",
              r"data 'text': option 'pack_attention': expected one of row, document, got string \"sequence\""),
    text_case("pack_attention a boolean", "files = { 'data/*.jsonl' }, pack = true, pack_attention = true",
              r"data 'text': option 'pack_attention': expected string, got boolean true"),
    text_case("pack_attention without pack", "files = { 'data/*.jsonl' }, pack_attention = 'document'",
              r"data 'text': pack_attention = 'document' without pack = true, expected pack = true"),
    text_case("eval_files without sources", "eval_files = { 'more.txt' }",
              r"data 'text': eval_files is given without files or file, expected the sources it applies to"),
]
