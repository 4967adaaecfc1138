-- The optimizer's memory floor: bytes of optimizer state per parameter and
-- the step's peak (bytes held by CPU tensors, the counting allocator) for
-- fp32 AdamW and 8-bit AdamW (adamw8bit) at Qwen2.5-0.5B's shapes (vocabulary
-- 151,936, hidden 896, MLP 4864, 14 heads, 2 KV heads, tied head; `layers` of
-- its 24 blocks, every tensor at its real shape), one short batch so that the
-- weights, gradients and state dominate. Ratios are to adamw, in one run.
--   wick run bench/optim_state.lua [layers=2] [micro=1] [seq=64] [steps=2]
-- layers=24 is the whole 0.5 B model (about 8 GiB with adamw on the CPU).
local wick = require "wick"
local core = wick.core
local a = wick.args
local layers, micro, seq, steps = a.layers or 2, a.micro or 1, a.seq or 64, a.steps or 2

local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(micro * (steps + 1), seq)
local data = wick.data("text", { file = file, max_length = seq })

local function gib(b) return b / 2 ^ 30 end
print(string.format("decoder_lm: Qwen2.5-0.5B shapes, %d of 24 layers, batch %d x %d tokens, fp32 weights, cpu",
  layers, micro, seq))
print(string.format("%-10s %12s %10s %10s %8s %10s %10s %8s %8s %9s", "optim", "params", "state GiB", "B/param",
  "ratio", "expected", "peak GiB", "ratio", "s/step", "loss"))
local base_state, base_peak
for _, name in ipairs { "adamw", "adamw8bit" } do
  collectgarbage()
  wick.seed(0)
  local model = wick.model("decoder_lm", { family = "qwen2", vocab_size = 151936, hidden_size = 896,
    intermediate_size = 4864, layers = layers, heads = 14, kv_heads = 2, tie_embeddings = true })
  local trainer = core.trainer { model = model, optim = wick.optim(name, { lr = 1e-4 }), device = "cpu" }
  local loader = core.loader(data, { micro_batch = micro, accumulate = 1, shuffle = false })
  loader:start_epoch(0)
  trainer:step(loader:next())  -- allocates the state; not measured
  collectgarbage()
  core.reset_peak()
  local t0, rec = core.now(), nil
  for _ = 1, steps do rec = trainer:step(loader:next()) end
  local dt = (core.now() - t0) / steps
  local peak = core.memory(false).cpu_tensors_peak
  local m = trainer:memory_breakdown()
  local params = m.trainable / 4
  base_state, base_peak = base_state or m.optimizer, base_peak or peak
  print(string.format("%-10s %12d %10.3f %10.3f %7.3fx %10.3f %10.3f %7.3fx %8.2f %9.4f", name, params, gib(m.optimizer),
    m.optimizer / params, m.optimizer / base_state, gib(m.optimizer_expected), gib(peak), peak / base_peak, dt, rec.loss))
  model, trainer, loader = nil, nil, nil
end
os.remove(file)
print("state: bytes of the optimizer's tensors after its first step (expected: what it declares beforehand);")
print("peak: most bytes held by tensors over the measured steps (weights, gradients, state, activations,")
print("the step's temporaries). s/step is noisy on a shared machine. Ratios: to adamw.")
