-- Seed 003 (shared/seeds/003_*): LLaVA-1.5-7B (a LLaMA-2-7B decoder and CLIP
-- ViT-L/14 at 336 pixels) fine-tuned with QLoRA on an 8 GB card. The seed's
-- settings: 4-bit NF4 with double-quantized constants, rank 8 (alpha 16,
-- dropout 0.05), micro-batch 1 x accumulate 32, bf16 mixed precision,
-- gradient checkpointing, max_length 512, image_size 336. Its figure: 4.2 GB
-- estimated (5-7 GB in practice). Here every linear weight of the decoder is
-- quantized as it is made or read (the 16-bit model never exists), the frozen
-- tower's linear weights too (as bitsandbytes' load_in_4bit does), the
-- projector stays frozen in bf16, and the adapters' moments are 8-bit.
--   wick make-clips clips --per-class 64 --no-extras
--   wick run configs/seeds/003_llava_qlora.lua [clips=clips] [shape=small|real] [epochs=N]
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local prompt = "<image>" .. string.rep("USER: what does the picture show? ASSISTANT: ", 10)
return dofile(here .. "/lib.lua").main {
  name = "003", title = "LLaVA-1.5-7B QLoRA: CLIP ViT-L/14-336 + LLaMA-2-7B, 8 GB",
  goal = 4.2 * 2 ^ 30, figure = "4.2 GB estimated; 5-7 GB in practice",
  model = {
    plugin = "vlm",
    common = { freeze_vision = true, freeze_projector = true, projector = "mlp2x_gelu", vision_style = "clip",
      quantize = "nf4", quantize_vision = true, dtype = "bf16" },
    small = { image_size = 32, patch_size = 8, vision_hidden_size = 64, vision_intermediate_size = 128,
      vision_layers = 2, vision_heads = 4, hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4,
      dtype = "fp32" },
    -- llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336 (576 patches) and LLaMA-2-7B
    real = { image_size = 336, patch_size = 14, vision_hidden_size = 1024, vision_intermediate_size = 4096,
      vision_layers = 24, vision_heads = 16, family = "llama", vocab_size = 32000, hidden_size = 4096,
      intermediate_size = 11008, layers = 32, heads = 32, kv_heads = 32, tie_embeddings = false },
    from_data = function(o, data, shape)
      o.image_token_id = data.image_token_id
      if shape == "small" then o.vocab_size = data.vocab_size end
    end,
  },
  depth = { "layers", "vision_layers" },  -- the options holding layer counts (bench/seeds.lua)
  transform = { "qlora", { r = 8, alpha = 16, dropout = 0.05, target_modules = { "all-linear" } } },
  data = { kind = "images", make = { small = "--per-class 64 --no-extras", real = "--per-class 64 --no-extras" },
    common = { resize = "exact", tokenizer = "bytes", prompt = prompt },
    small = { image_size = 32, text_length = 512 }, real = { image_size = 336, text_length = 512 } },
  optim = { "adamw8bit", { lr = 2e-4, weight_decay = 0, min_8bit_size = 4096 }, small = { lr = 3e-3 } },
  -- offload_activations and offload_embeddings: wick's additions (the same
  -- gradients): the 32 kept block inputs wait in host memory, not on the
  -- card, and so does the frozen 32,000 x 4,096 input embedding (0.24 GiB),
  -- whose lookups bring only a sample's rows to the card
  train = { micro_batch = 1, accumulate = 32, checkpointing = true, offload_activations = true,
    offload_embeddings = true, precision = "bf16-mixed", seed = 1 },
  train_at = { small = { precision = "fp32", micro_batch = 4, accumulate = 2 } },
  epochs = { small = 2, real = 1 },
}
