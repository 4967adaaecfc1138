-- Seed 000 (shared/seeds/000_*): MicroVLM-V, a ViT-B/16 tower and
-- Qwen2.5-0.5B joined by a projector, captioning images on a 12 GB GTX 1080.
-- The seed's settings: micro-batch 8 x accumulate 8 (its stage 1; the batch
-- of 64 kept), mixed precision, gradient checkpointing on the language model,
-- clipping at 1.0, the cache emptied every 10 micro-batches. Its figure: 9.7 GB
-- before, "~4-5 GB" estimated after. wick's way to 4 GB with the whole
-- language model training: bf16 weights (the tower frozen, as MicroVLM-V
-- keeps it), 8-bit AdamW moments, checkpointing, and a chunked output head
-- over Qwen's 151,936-token vocabulary.
--   wick make-clips clips --per-class 64 --no-extras
--   wick run configs/seeds/000_microvlm.lua [clips=clips] [shape=small|real] [epochs=N]
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
return dofile(here .. "/lib.lua").main {
  name = "000", title = "MicroVLM-V: ViT-B/16 + Qwen2.5-0.5B, 12 GB GTX 1080",
  goal = 4 * 2 ^ 30, figure = "9.7 GB before; 4-5 GB after (estimated)",
  model = {
    plugin = "vlm",
    common = { freeze_vision = true, projector = "mlp2x_gelu", vision_feature_layer = -1, vision_style = "vit" },
    small = { image_size = 32, patch_size = 8, vision_hidden_size = 48, vision_intermediate_size = 96,
      vision_layers = 2, vision_heads = 4, family = "qwen2", hidden_size = 64, intermediate_size = 128, layers = 4,
      heads = 4, kv_heads = 2, tie_embeddings = true },
    -- ViT-B/16 at 224 (196 patches) and Qwen2.5-0.5B (config.json's sizes), bf16
    real = { image_size = 224, patch_size = 16, vision_hidden_size = 768, vision_intermediate_size = 3072,
      vision_layers = 12, vision_heads = 12, family = "qwen2", vocab_size = 151936, hidden_size = 896,
      intermediate_size = 4864, layers = 24, heads = 14, kv_heads = 2, tie_embeddings = true, rope_theta = 1000000,
      dtype = "bf16" },
    from_data = function(o, data, shape)
      o.image_token_id = data.image_token_id
      if shape == "small" then o.vocab_size = data.vocab_size end
    end,
  },
  depth = { "layers", "vision_layers" },  -- the options holding layer counts (bench/seeds.lua)
  data = { kind = "images", make = { small = "--per-class 64 --no-extras", real = "--per-class 64 --no-extras" },
    common = { resize = "exact", tokenizer = "bytes", prompt = "<image>", text_length = 64 },
    small = { image_size = 32 }, real = { image_size = 224 } },
  optim = { "adamw8bit", { lr = 1e-4, weight_decay = 0.01 }, small = { lr = 3e-3 } },
  train = { micro_batch = 8, accumulate = 8, checkpointing = true, clip_grad_norm = 1.0, empty_cache_every = 10,
    precision = "bf16-true", seed = 1 },
  -- small: fp32 so that a CPU without bf16 arithmetic trains it in seconds
  train_at = { small = { precision = "fp32", micro_batch = 8, accumulate = 2 } },
  epochs = { small = 3, real = 1 },
}
