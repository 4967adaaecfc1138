-- The out-of-memory guide's table, measured: peak memory held by tensors and
-- time per optimizer step for the decoder language model (6 blocks, hidden
-- 512, sequence 256) on this machine's CPU, for the baseline, each knob alone
-- and all together, with the ratio to the baseline, from one run.
--   wick run bench/memory.lua [steps=3] [micro=4] [accumulate=2] [layers=6] [hidden=512] [seq=256] [fp16=true]
-- The effective batch (micro x accumulate) is the same in every row; every
-- row starts from the same weights and sees the same tokens.
local wick = require "wick"
local core = wick.core
local a = wick.args
local steps, micro, acc = a.steps or 3, a.micro or 4, a.accumulate or 2
local layers, hidden, seq = a.layers or 6, a.hidden or 512, a.seq or 256

-- random token sequences (vocabulary 256), pre-tokenized JSONL
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(micro * acc * (steps + 1), seq)
local data = wick.data("text", { file = file, max_length = seq })

local configs = {
  { "baseline (fp32)", {} },
  { "precision = bf16-mixed", { precision = "bf16-mixed" } },
  { "precision = bf16-true", { precision = "bf16-true" } },
  { "checkpointing = true", { checkpointing = true } },
  { "micro_batch / 2, accumulate x 2", { split = 2 } },
  { "all: bf16-mixed + checkpointing + micro / 2", { precision = "bf16-mixed", checkpointing = true, split = 2 } },
}

-- fp16 matrix products have no fast kernels on most CPUs (minutes per step at
-- this size): its row is measured on request, fp16=true, or on a GPU
if a.fp16 then table.insert(configs, 3, { "precision = fp16-mixed", { precision = "fp16-mixed" } }) end

local function mib(b) return b / 2 ^ 20 end

print(string.format("decoder_lm: %d blocks, hidden %d, sequence %d, micro-batch %d x accumulate %d, %d timed steps, cpu",
  layers, hidden, seq, micro, acc, steps))
print(string.format("%-44s %12s %8s %12s %8s %10s", "setting", "peak MiB", "ratio", "s/step", "ratio", "loss"))
local base_peak, base_time
for _, cfg in ipairs(configs) do
  local name, o = cfg[1], cfg[2]
  collectgarbage()
  wick.seed(0)
  local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = hidden, intermediate_size = math.floor(hidden * 11 / 4),
    layers = layers, heads = 8 })
  local trainer = core.trainer { model = model, optim = wick.optim("adamw", { lr = 1e-4 }), device = "cpu",
    precision = o.precision or "fp32", checkpointing = o.checkpointing or false }
  local split = o.split or 1
  local loader = core.loader(data, { micro_batch = math.floor(micro / split), accumulate = acc * split, shuffle = false })
  loader:start_epoch(0)
  local rec = trainer:step(loader:next())  -- warm-up: allocates the optimizer state, not timed
  core.reset_peak()
  local t0 = core.now()
  for _ = 1, steps do rec = trainer:step(loader:next()) end
  local dt = (core.now() - t0) / steps
  local peak = core.memory(false).cpu_tensors_peak
  base_peak, base_time = base_peak or peak, base_time or dt
  print(string.format("%-44s %12.1f %7.2fx %12.3f %7.2fx %10.4f", name, mib(peak), peak / base_peak, dt, dt / base_time,
    rec.loss))
  model, trainer, loader = nil, nil, nil
end
os.remove(file)
print("peak: most bytes held by tensors during the timed steps (weights, gradients, AdamW state, activations);")
print("ratio: to the baseline. Same effective batch in every row.")
