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

