-- LoRA fine-tuning of a saved decoder: the model configs/lm_scratch.lua saved
-- (license texts) adapts to the BSD and MIT-style permissive licenses with
-- rank-8 adapters on every linear layer, the base frozen; it writes the same
-- prompt's continuation before and after and saves the adapter as PEFT does.
--   wick run configs/lm_scratch.lua && wick run configs/lm_lora.lua [base=DIR] [epochs=N]
local wick = require "wick"

local base = wick.args.base or "runs/lm_scratch/model"
local f = io.open(base .. "/config.json")
if not f then error("no model in " .. base .. ": run configs/lm_scratch.lua first (or give base=DIR)", 0) end
f:close()

local dir = "/usr/share/common-licenses/"
local files = {}
for _, name in ipairs { "BSD", "CC0-1.0", "GPL-1", "MPL-1.1" } do
  local h = io.open(dir .. name)
  if h then h:close(); files[#files + 1] = dir .. name end
end
local data = wick.data("text", { files = files, max_length = 128, pack = true })
local model = wick.model("decoder_lm", { path = base })
local lora = wick.optim("lora", { r = 8, alpha = 16, target_modules = { "all-linear" } })
lora:apply(model)
local total, trainable = model:parameters()
print(string.format("LoRA on %d layers: %d of %d parameters train (%.1f%%)", lora.layers, trainable, total,
  100 * trainable / total))

local prompt = data:encode("Redistribution ")
local function sample()
  local ids = model:generate(prompt, { max_new_tokens = 80, eos_id = data.eos_id, temperature = 0.7, top_k = 20, seed = 1 })
  return (data:decode(ids):gsub("%s+", " "):gsub("[%c\128-\255]", "?"))
end
print("before: Redistribution " .. sample())
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 5e-3, weight_decay = 0 }),
  micro_batch = 8, accumulate = 2, epochs = 6, clip_grad_norm = 1.0,
  out = wick.args.out or "runs/lm_lora", log_every = 20, seed = 1,
}
print("after:  Redistribution " .. sample())
lora:save(model, (wick.args.out or "runs/lm_lora") .. "/adapter")
print(string.format("final loss %.3f, %d steps; adapter in %s/adapter", run.final_loss, run.steps,
  wick.args.out or "runs/lm_lora"))
