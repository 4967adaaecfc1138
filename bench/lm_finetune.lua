-- One row of bench/lm_finetune.sh: fine-tunes the decoder language model (6
-- blocks, hidden 512, sequences of 256 tokens by default) on random tokens
-- for a few AdamW steps, fully, with LoRA or with QLoRA, and prints tokens per
-- second (steps after the first) and peak memory.
--   wick run bench/lm_finetune.lua mode=full|lora|qlora [steps=6] [micro=4] [seq=256] [device=cpu|cuda]
--     [precision=fp32|bf16-mixed] [hidden=512] [inter=1408] [layers=6] [heads=8] [vocab=257] [profile=DIR]
-- device=cuda: precision bf16-mixed unless given, 12 steps unless given,
-- every step's numbers read at its end (a synchronisation), and tokens per
-- second the median over steps 3 to N, each timed from the end of the step
-- before's launch to the end of its own (step 1 warms up). One line:
--   RESULT mode=full tps=T peak=B reserved=B device=B rss=B params=N trainable=N
-- (bytes; reserved and device n/a on the CPU, where peak is the bytes held by
-- CPU tensors).
-- profile=DIR: steps 2 to N under wick.train's profile instead, the trace in
-- DIR/wick-lm_MODE/, and PROFILE lines (bench/profile_lines.lua) in place of
-- the RESULT line (bench/lm_finetune.py --profile DIR prints the peer's).
local wick = require "wick"
local a = wick.args
local device = tostring(a.device or "cpu")
local cuda = device:match("^cuda") ~= nil
if cuda and not wick.core.cuda_available() then error("device=" .. device .. ": this wick sees no usable CUDA device", 0) end
local mode = a.mode or "full"
local steps = tonumber(a.steps or (cuda and 12 or 6))
local micro, seq = tonumber(a.micro or 4), tonumber(a.seq or 256)
local precision = a.precision or (cuda and "bf16-mixed" or "fp32")
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(steps * micro, seq)
local data = wick.data("text", { file = file, max_length = seq })
wick.seed(0)
local model = wick.model("decoder_lm", { vocab_size = tonumber(a.vocab or 257), hidden_size = tonumber(a.hidden or 512),
  intermediate_size = tonumber(a.inter or 1408), layers = tonumber(a.layers or 6), heads = tonumber(a.heads or 8) })
if mode ~= "full" then
  wick.optim(mode, { r = 8, alpha = 16, target_modules = { "all-linear" } }):apply(model)
end
local total, trainable = model:parameters()
local profiled = a.profile and (a.profile .. "/wick-lm_" .. mode) or nil
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-4 }),
  micro_batch = micro, max_steps = steps, shuffle = false, quiet = true, device = device, precision = precision,
  log_every = cuda and 1 or nil, overrides = false,
  out = profiled, overwrite = profiled and true or nil, profile = profiled and { 2, steps } or nil }
os.remove(file)
if profiled then
  dofile(here .. "/profile_lines.lua")("lm_" .. mode, "depth=layers=" .. (a.layers or 6), run.profile)
  return
end
local h = run.history
local tokens, seconds = 0, 0
if cuda and #h >= 3 then
  -- step i's record time: when its launch ended (then it was waited for, and
  -- step i+1 started): from step i's to step i+1's is one step's time (step
  -- i's end on the device, step i+1's launch). The median of those from step
  -- 2 on, as bench/lm_finetune.py takes the median of its steps
  local rates = {}
  for i = 2, #h - 1 do rates[#rates + 1] = h[i + 1].items / (h[i + 1].time - h[i].time) end
  table.sort(rates)
  local n = #rates
  tokens, seconds = n % 2 == 1 and rates[(n + 1) / 2] or (rates[n / 2] + rates[n / 2 + 1]) / 2, 1
else
  for i = 2, #h do
    tokens = tokens + h[i].items
    seconds = seconds + h[i].seconds
  end
end
local m = run.memory
local function b(x) x = tonumber(x) or 0 return x > 0 and string.format("%d", x) or "n/a" end
print(string.format("RESULT mode=%s tps=%.1f peak=%s reserved=%s device=%s rss=%s params=%d trainable=%d steps=%d precision=%s",
  mode, tokens / seconds, b(m.peak), b(m.reserved_peak), b(m.device_peak), b(wick.memory(false).peak_resident), total,
  trainable, run.steps, precision))
