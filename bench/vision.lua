-- One row of bench/vision.sh: the video classifier or the LLaVA-style VLM
-- (sizes as bench/vision.py gives transformers) trained for a few AdamW steps
-- on the batches in FILE; prints milliseconds per step (the median of the
-- steps after the first), the tensor peak and the process's peak resident set in MiB.
--   wick run bench/vision.lua model=video|vlm file=FILE [checkpointing=true]
local wick = require "wick"
local a = wick.args
local kind, steps = a.model or "video", 11  -- as bench/vision.py
local ck = a.checkpointing == true or a.checkpointing == "true"
local data = wick.data("tensors", { file = a.file })
wick.seed(0)
local model
if kind == "video" then
  model = wick.model("video_classifier", { classes = 10, image_size = 112, patch_size = 16, hidden_size = 192,
    intermediate_size = 768, layers = 4, heads = 3, style = "vit", temporal = "transformer", temporal_layers = 1,
    max_frames = 8 })
else
  model = wick.model("vlm", { image_token_id = 257, image_size = 64, patch_size = 8, vision_hidden_size = 192,
    vision_intermediate_size = 768, vision_layers = 4, vision_heads = 3, vocab_size = 258, hidden_size = 256,
    intermediate_size = 688, layers = 4, heads = 4, freeze_vision = true })
end
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-4, weight_decay = 0 }),
  micro_batch = 4, max_steps = steps, shuffle = false, quiet = true, checkpointing = ck }
local seconds = {}
for i = 2, #run.history do seconds[#seconds + 1] = run.history[i].seconds end
table.sort(seconds)
print(string.format("RESULT %.1f %.1f %.1f", 1000 * seconds[math.floor((#seconds + 1) / 2)], run.memory.peak / 2 ^ 20,
  wick.memory(false).peak_resident / 2 ^ 20))
