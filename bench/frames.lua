-- Memory of a video LLM step against the number of frames (issue 19): the
-- vlm of seed 001's small shape (a ViT tower, frozen or with tower=trained
-- trained as the small form trains it; frames through it
-- `frame_chunk` at a time under checkpointing, each frame pooled to
-- `frame_tokens` tokens, `time_pool` frames averaged into one) on clips made
-- by `wick make-clips` (bench/frames.sh makes them), one optimizer step per
-- setting after a warm-up step. The peak bytes held by tensors, less the input
-- frames themselves, should grow with the language model's token count and
-- not otherwise with T: 100 frames pooled 4 to 1 in time should cost what 25
-- frames cost, plus at most their own bytes.
-- A trained tower runs each chunk as the block model.vision_tower.frames,
-- checkpointed: the forward keeps the chunk's input frames, the backward
-- runs tower and pooling again chunk by chunk.
--   wick run bench/frames.lua clips=DIR [micro=2] [frame_chunk=20] [frame_tokens=4] [tower=trained]
local wick = require "wick"
local core = wick.core
local a = wick.args
assert(a.clips, "clips=DIR: clips of 100 frames (bench/frames.sh makes them)")
local micro, chunk, ft = a.micro or 2, a.frame_chunk or 20, a.frame_tokens or 4
local trained = a.tower == "trained"
assert(a.tower == nil or trained or a.tower == "frozen", "tower=frozen or tower=trained, not " .. tostring(a.tower))
local function mib(b) return b / 2 ^ 20 end

local settings = { { 8, 1 }, { 25, 1 }, { 32, 1 }, { 100, 1 }, { 100, 4 } }
print(string.format("vlm: ViT tower 2 x 48 at 32 px (%s), decoder 2 x 64, frame_chunk %d, frame_tokens %d, micro-batch %d, fp32, cpu",
  trained and "trained" or "frozen", chunk, ft, micro))
print(string.format("%6s %9s %10s %10s %10s %12s %14s", "frames", "time_pool", "LM tokens", "peak MiB", "frames MiB",
  "rest MiB", "rest/LM token"))
local rows = {}
for _, s in ipairs(settings) do
  local T, tp = s[1], s[2]
  collectgarbage()
  local data = wick.data("video_folder", { manifest = a.clips .. "/manifest.csv", max_frames = T, image_size = 32,
    resize = "exact", tokenizer = "bytes", prompt = "<image>", text_length = 64 })
  wick.seed(0)
  local model = wick.model("vlm", { image_size = 32, patch_size = 8, vision_hidden_size = 48, vision_intermediate_size = 96,
    vision_layers = 2, vision_heads = 4, hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4,
    frame_tokens = ft, frame_chunk = chunk, time_pool = tp, freeze_vision = not trained, projector = "mlp2x_gelu",
    vision_style = "clip", image_token_id = data.image_token_id, vocab_size = data.vocab_size })
  local trainer = core.trainer { model = model, optim = wick.optim("adamw", { lr = 1e-4 }), device = "cpu",
    checkpointing = true }
  local loader = core.loader(data, { micro_batch = micro, accumulate = 1, shuffle = false })
  loader:start_epoch(0)
  trainer:step(loader:next())  -- warm-up: the optimizer state exists from here on
  local window = loader:next()
  core.reset_peak()
  trainer:step(window)
  local peak = core.memory(false).cpu_tensors_peak
  local frames = micro * T * 3 * 32 * 32 * 4  -- the window's input frames, float32
  local tokens = micro * (math.ceil(T / tp) * ft + 64)  -- visual tokens and the text around them, per micro-batch
  rows[#rows + 1] = { T = T, tp = tp, tokens = tokens, peak = peak, rest = peak - frames }
  print(string.format("%6d %9d %10d %10.2f %10.2f %12.2f %14s", T, tp, tokens, mib(peak), mib(frames), mib(peak - frames),
    (#rows > 1 and tp == 1) and string.format("%.0f B", (peak - frames - rows[1].rest) / (tokens - rows[1].tokens)) or "-"))
  model, trainer, loader, data = nil, nil, nil, nil
end
-- linear in the LM's tokens: the line through T = 8 and T = 100 predicts T = 32
local r8, r32, r100 = rows[1], rows[3], rows[4]
local predicted = r8.rest + (r100.rest - r8.rest) * (r32.tokens - r8.tokens) / (r100.tokens - r8.tokens)
print(string.format("T = 32 on the line through T = 8 and 100: measured %.2f MiB, predicted %.2f (%.1f%%)", mib(r32.rest),
  mib(predicted), 100 * (r32.rest / predicted - 1)))
local extra = rows[5].peak - rows[2].peak
print(string.format("100 frames pooled 4 to 1 against 25 frames (the same LM tokens): peak %+.2f MiB, within the %.2f MiB "
  .. "of the 75 more input frames: %s", mib(extra), mib(rows[5].peak - rows[5].rest - (rows[2].peak - rows[2].rest)),
  extra <= rows[5].peak - rows[5].rest - (rows[2].peak - rows[2].rest) and "yes" or "NO"))
