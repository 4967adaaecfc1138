-- Seed 004 (shared/seeds/004_*): a 34 M decoder language model trained from
-- scratch on a 12 GB AMD card (ROCm). The seed's settings: micro-batch 2 x
-- accumulate 16 (the batch of 32 kept), max_seq_length 512, gradient
-- checkpointing. Its figure: 0.63 GB peak for forward and backward at batch
-- 2 x 512 (its own measurement), 2.6 GB estimated for the whole step. The
-- real shape: hidden 512, 8 layers, 8 heads, MLP 1408, vocabulary 16,384,
-- tied head (34.1 M parameters).
--   wick make-clips clips --per-class 64 --no-extras
--   wick run configs/seeds/004_gearhead_lm.lua [clips=clips] [shape=small|real] [epochs=N]
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
return dofile(here .. "/lib.lua").main {
  name = "004", title = "34 M decoder LM from scratch, batch 2 x 512, 12 GB ROCm",
  goal = 0.63 * 2 ^ 30, figure = "0.63 GB forward + backward at 2 x 512 (measured); 2.6 GB step (estimated)",
  model = {
    plugin = "decoder_lm",
    small = { hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4, tie_embeddings = true },
    real = { vocab_size = 16384, hidden_size = 512, intermediate_size = 1408, layers = 8, heads = 8,
      tie_embeddings = true },
    from_data = function(o, data, shape)
      if shape == "small" then o.vocab_size = data.vocab_size end
    end,
  },
  depth = { "layers" },  -- the options holding layer counts (bench/seeds.lua)
  forward_backward = true,  -- the seed measured forward and backward alone
  data = { kind = "text", make = { small = "--per-class 64 --no-extras", real = "--per-class 64 --no-extras" },
    common = { tokenizer = "bytes", cache_dir = "none", pack = true, max_length = 512 },
    small = { max_length = 32 }, real = { fill_bytes = 65536 } },
  optim = { "adamw", { lr = 3e-4, weight_decay = 0.01 }, small = { lr = 3e-3 } },
  train = { micro_batch = 2, accumulate = 16, checkpointing = true, clip_grad_norm = 1.0, precision = "bf16-mixed",
    seed = 1 },
  train_at = { small = { precision = "fp32", micro_batch = 8, accumulate = 2 } },
  epochs = { small = 3, real = 1 },
}
