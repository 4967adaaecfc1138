-- Video classification on the toy clips `wick make-clips` writes (a coloured
-- shape moving over a plain background; the shape is the class). A small ViT
-- encodes every frame, a temporal transformer mixes the frames, a linear head
-- classifies. The memory knobs are one line each: max_frames (activation
-- memory grows linearly with it), image_size, bf16 autocast, activation
-- checkpointing of every block, accumulation (micro 4 x 4 = batch 16).
-- bf16 autocast is the default on CUDA; on a CPU the default is fp32, since
-- CPUs without bf16 arithmetic run it ~5x slower (precision=bf16-mixed forces it).
-- On 2 CPU cores: 1920 steps in about 4 minutes to held-out accuracy 1.0 over
-- 3 classes (0.71 after 20 epochs: a ViT from scratch needs the steps). A
-- small setting the test suite runs in about a minute (400 clips per class at
-- 64x48, held-out accuracy 0.59-0.74 over seeds): epochs=30 accumulate=1
-- micro_batch=8 image_size=48 max_frames=2 hidden=32 layers=1 lr=1e-3 pool=mean.
--
-- Make the clips once (a training and a held-out set, different seeds):
--   wick make-clips data/clips/train --classes 3 --per-class 256 --size 96x96 --seconds 1.28 --no-extras --no-images
--   wick make-clips data/clips/held_out --classes 3 --per-class 32 --size 96x96 --seconds 1.28 --seed 7 --no-extras --no-images
-- then:
--   wick run configs/video.lua [clips=data/clips] [max_frames=4] [image_size=48] [epochs=40] [lr=1e-3]
--                              [precision=fp32|bf16-mixed] [pool=cls|mean] [patch=8] [hidden=64] [layers=2] [out=DIR]
local wick = require "wick"
local a = wick.args
local clips = a.clips or "data/clips"
local max_frames = tonumber(a.max_frames) or 4
local image_size = tonumber(a.image_size) or 48

local f = io.open(clips .. "/train/manifest.csv", "r")
if not f then
  error("configs/video.lua: no clips in " .. clips .. "/train; make them first:\n" ..
        "  wick make-clips " .. clips .. "/train --classes 3 --per-class 256 --size 96x96 --seconds 1.28 --no-extras --no-images\n" ..
        "  wick make-clips " .. clips .. "/held_out --classes 3 --per-class 32 --size 96x96 --seconds 1.28 --seed 7 --no-extras --no-images", 0)
end
f:close()

local function clip_set(dir, train)
  return wick.data("video_folder", {
    root = dir .. "/videos", max_frames = max_frames, image_size = image_size,
    resize = "exact", sampling = train and "random_segment" or "uniform", flip = train, seed = 1,
  })
end
local train = clip_set(clips .. "/train", true)
local held_out = clip_set(clips .. "/held_out", false)

local model = wick.model("video_classifier", {
  classes = train.num_classes, image_size = image_size, patch_size = tonumber(a.patch) or 8, pool = a.pool or "cls",
  hidden_size = tonumber(a.hidden) or 64, intermediate_size = 2 * (tonumber(a.hidden) or 64), layers = tonumber(a.layers) or 2,
  heads = 4,
  temporal = "transformer", temporal_layers = 1, max_frames = max_frames,
})

local out = a.out or "runs/video"
local run = wick.train {
  model = model, data = train, optim = wick.optim("adamw", { lr = tonumber(a.lr) or 1e-3, weight_decay = 0.05 }),
  schedule = "cosine", warmup_steps = 5,
  micro_batch = 4, accumulate = 4, epochs = tonumber(a.epochs) or 40,
  precision = a.precision or (wick.device():find("^cuda") and "bf16-mixed" or "fp32"), checkpointing = true, clip_grad_norm = 1.0,
  eval_data = held_out, eval_every = 0, workers = 2,
  out = out, seed = 1,
}
model:save(out .. "/model.safetensors")
print(string.format("max_frames %d, image_size %d: final loss %.4f, held-out accuracy %.3f, %d steps, %.0f s, peak memory %.1f MiB",
  max_frames, image_size, run.final_loss, run.eval.accuracy, run.steps, run.seconds or 0, (run.peak_memory or 0) / 2^20))
