-- A small LLaMA-style decoder learns, from scratch, the license texts every
-- Debian machine carries (byte tokens, documents packed into 128-token chunks),
-- and writes a continuation of the same prompt before and after training.
--   wick run configs/lm_scratch.lua [epochs=N] [out=DIR]
local wick = require "wick"

local dir = "/usr/share/common-licenses/"
local files = {}
for _, name in ipairs { "GPL-3", "LGPL-3", "Apache-2.0", "MPL-2.0", "Artistic", "GFDL-1.3" } do
  local f = io.open(dir .. name)
  if f then f:close(); files[#files + 1] = dir .. name end
end
assert(#files > 0, "no license texts found in " .. dir)

local data = wick.data("text", { files = files, max_length = 128, pack = true })
local model = wick.model("decoder_lm", {
  vocab_size = data.vocab_size, hidden_size = 128, intermediate_size = 352, layers = 3, heads = 4, kv_heads = 2,
})
local prompt = data:encode("This License ")
local function sample()
  local ids = model:generate(prompt, { max_new_tokens = 80, eos_id = data.eos_id, temperature = 0.7, top_k = 20, seed = 1 })
  return (data:decode(ids):gsub("%s+", " "):gsub("[%c\128-\255]", "?"))
end
print(string.format("%d license files, %d tokens in %d chunks", #files, data.tokens, data:size()))
print("before: This License " .. sample())

local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 3e-3, weight_decay = 0.01 }),
  schedule = wick.schedule("cosine", { warmup_steps = 20 }),
  micro_batch = 8, accumulate = 2, epochs = 8, clip_grad_norm = 1.0,
  out = wick.args.out or "runs/lm_scratch", log_every = 20, seed = 1,
}

print("after:  This License " .. sample())
local out = wick.args.out or "runs/lm_scratch"
wick.save_pretrained(model, out .. "/model")  -- wick generate runs/lm_scratch/model tokenizer=bytes prompt="This License "
print(string.format("final loss %.3f (%.2f bits per byte), %d steps", run.final_loss, run.final_loss / math.log(2), run.steps))
