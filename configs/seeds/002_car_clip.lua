-- Seed 002 (shared/seeds/002_*): fine-tuning CLIP ViT-B/32 on image-caption
-- pairs; it crashed at 7.5 GB with a batch of 128. The seed's settings:
-- micro-batch 16 x accumulate 8 (the batch of 128 kept), fp16 mixed
-- precision, clipping at 1.0, the cache emptied every 10 micro-batches,
-- prefetch 2, AdamW at 2e-5. Its figure: 3-4 GB. wick's accumulation here is
-- exact: the contrastive loss is over the whole window of 128 pairs, as a
-- real batch of 128 (plain accumulation, the seed's, scores each pair
-- against 16 only). Mixed precision here is bf16 (precision=fp16-mixed on a
-- card without bf16, as the seed's: the same bytes, plus loss scaling).
-- wick adds activation checkpointing of both towers' layers (the seed had
-- none): the same gradients, and at the real shape 0.60 GiB of activations
-- become 0.14 (bench/seeds.sh seeds=002).
--   wick make-clips clips --per-class 64 --no-extras
--   wick run configs/seeds/002_car_clip.lua [clips=clips] [shape=small|real] [epochs=N]
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
return dofile(here .. "/lib.lua").main {
  name = "002", title = "CLIP ViT-B/32 fine-tune, batch 128",
  goal = 3 * 2 ^ 30, figure = "7.5 GB before (crashed); 3-4 GB after",
  model = {
    plugin = "clip",
    common = { accumulation = "exact" },
    small = { image_size = 32, patch_size = 8, hidden_size = 48, intermediate_size = 96, layers = 2, heads = 4,
      text_hidden_size = 48, text_intermediate_size = 96, text_layers = 2, text_heads = 4, projection_dim = 32,
      max_length = 64 },
    -- openai/clip-vit-base-patch32
    real = { image_size = 224, patch_size = 32, hidden_size = 768, intermediate_size = 3072, layers = 12, heads = 12,
      vocab_size = 49408, text_hidden_size = 512, text_intermediate_size = 2048, text_layers = 12, text_heads = 8,
      projection_dim = 512, max_length = 77 },
    from_data = function(o, data, shape)
      o.eos_token_id = data.eos_id
      if shape == "small" then o.vocab_size = data.vocab_size end
    end,
  },
  depth = { "layers", "text_layers" },  -- the options holding layer counts (bench/seeds.lua)
  data = { kind = "images", make = { small = "--per-class 64 --no-extras", real = "--per-class 64 --no-extras" },
    common = { resize = "exact", tokenizer = "bytes", image_token = "" },
    small = { image_size = 32, text_length = 64 }, real = { image_size = 224, text_length = 77 } },
  optim = { "adamw", { lr = 2e-5, weight_decay = 0.01 }, small = { lr = 1e-3 } },
  train = { micro_batch = 16, accumulate = 8, clip_grad_norm = 1.0, empty_cache_every = 10, prefetch = 2,
    precision = "bf16-mixed", checkpointing = true, seed = 1 },
  train_at = { small = { precision = "fp32", accumulate = 2 } },
  epochs = { small = 3, real = 1 },
}
