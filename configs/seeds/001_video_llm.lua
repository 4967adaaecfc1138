-- Seed 001 (shared/seeds/001_*): a 2 B video LLM over 100 frames per clip on
-- 8-16 GB cards. The seed's settings: bf16 language model, mixed precision,
-- gradient checkpointing, max_frames 100, micro-batch 4 x accumulate 8 (the
-- batch of 32 kept). Its figure: 4-6 GB "per batch" (its breakdown counts
-- 2 GB for 2 B bf16 weights, which are 4 GB). The tower here is CLIP
-- ViT-L/14 at 224 (frozen, bf16), 20 frames through it at a time; each
-- frame's 16x16 patch grid is pooled to 4x4 tokens, so 100 frames are 1,600
-- visual tokens; the language model (LLaMA-style, 1.9 B: hidden 2048, 24
-- layers, 92,544-token vocabulary, untied head) learns through rank-16 LoRA
-- on every linear layer, the projector trained in full. The small shape keeps
-- these settings (bf16 weights, bf16-mixed, 100 frames, 4 x 8) and trains
-- the tower, the final norm and the head too: its weights are random, and a
-- frozen random tower or head carries nothing a pretrained one would. With
-- heldout=DIR it reports whether the model reads the clips: the held-out loss
-- with each clip's own caption against the same captions on other clips.
--   wick make-clips clips --per-class 48 --seconds 4 --fps 25 --size 64x64 --no-extras --no-images
--   wick make-clips held --seed 7 --per-class 8 --seconds 4 --fps 25 --size 64x64 --no-extras --no-images
--   wick run configs/seeds/001_video_llm.lua [clips=clips] [heldout=held] [shape=small|real] [epochs=N]
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
return dofile(here .. "/lib.lua").main {
  name = "001", title = "video LLM: CLIP ViT-L/14 + 1.9 B decoder, 100 frames, 8-16 GB",
  goal = 6 * 2 ^ 30, figure = "4-6 GB after (weights counted at half their size)",
  model = {
    plugin = "vlm",
    common = { freeze_vision = true, projector = "mlp2x_gelu", vision_style = "clip", frame_chunk = 20 },
    small = { image_size = 32, patch_size = 8, vision_hidden_size = 48, vision_intermediate_size = 96,
      vision_layers = 2, vision_heads = 4, hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4,
      frame_tokens = 4, dtype = "bf16" },
    real = { image_size = 224, patch_size = 14, vision_hidden_size = 1024, vision_intermediate_size = 4096,
      vision_layers = 24, vision_heads = 16, family = "llama", vocab_size = 92544, hidden_size = 2048,
      intermediate_size = 8192, layers = 24, heads = 16, kv_heads = 8, tie_embeddings = false, rope_theta = 1000000,
      dtype = "bf16", frame_tokens = 16 },
    from_data = function(o, data, shape)
      o.image_token_id = data.image_token_id
      if shape == "small" then o.vocab_size = data.vocab_size end
    end,
  },
  depth = { "layers", "vision_layers" },  -- the options holding layer counts (bench/seeds.lua)
  transform = { "lora", { r = 16, alpha = 32, dropout = 0.05, target_modules = { "all-linear" },
    modules_to_save = { "multi_modal_projector" } } },
  unfreeze = { small = { "model.vision_tower", "model.language_model.norm", "lm_head" } },
  data = { kind = "clips", make = { small = "--per-class 48 --seconds 4 --fps 25 --size 64x64 --no-extras --no-images",
      real = "--per-class 16 --seconds 4 --fps 25 --size 224x224 --no-extras --no-images" },
    common = { max_frames = 100, resize = "exact", tokenizer = "bytes", prompt = "<image>", text_length = 64 },
    -- real: each batch's caption padded to a multiple of 8 tokens (after
    -- the real ones: the same loss), so the language model sees two or three
    -- sequence lengths, not one per longest caption: on a Hopper GPU cuDNN's
    -- attention plans each new length anew, 45-75 ms a pass (H200, 2026-11-28)
    small = { image_size = 32 }, real = { image_size = 224, pad_to_multiple_of = 8 } },
  optim = { "adamw", { lr = 2e-4, weight_decay = 0 }, small = { lr = 3e-3 } },
  -- offload_activations and offload_embeddings: wick's additions (the same
  -- gradients): the 24 kept block inputs (4 clips x 1,600 frame tokens and
  -- the caption, 2,048 wide) wait in host memory, not on the card, and so
  -- does the frozen 92,544 x 2,048 input embedding (0.35 GiB in bf16)
  train = { micro_batch = 4, accumulate = 8, checkpointing = true, offload_activations = true,
    offload_embeddings = true, clip_grad_norm = 1.0, precision = "bf16-mixed", seed = 1 },
  epochs = { small = 30, real = 1 },
}
