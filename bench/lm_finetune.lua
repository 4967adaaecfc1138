-- One row of bench/lm_finetune.sh: fine-tunes the decoder language model (6
-- blocks, hidden 512, sequences of 256 tokens) on random tokens for a few
-- AdamW steps, fully, with LoRA or with QLoRA, and prints tokens per second
-- (steps after the first) and peak memory.
--   wick run bench/lm_finetune.lua mode=full|lora|qlora [steps=4] [micro=4]
local wick = require "wick"
local a = wick.args
local mode, steps, micro, seq = a.mode or "full", a.steps or 6, a.micro or 4, a.seq or 256
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(steps * micro, seq)
local data = wick.data("text", { file = file, max_length = seq })
wick.seed(0)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 512, intermediate_size = 1408, layers = 6,
  heads = 8 })
if mode ~= "full" then
  wick.optim(mode, { r = 8, alpha = 16, target_modules = { "all-linear" } }):apply(model)
end
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-4 }),
  micro_batch = micro, max_steps = steps, shuffle = false, quiet = true }
os.remove(file)
local tokens, seconds = 0, 0
for i = 2, #run.history do
  tokens = tokens + run.history[i].items
  seconds = seconds + run.history[i].seconds
end
print(string.format("RESULT %.1f %.1f %.1f", tokens / seconds, run.memory.peak / 2 ^ 20,
  wick.memory(false).peak_resident / 2 ^ 20))
