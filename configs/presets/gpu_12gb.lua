-- Preset for 12 GB cards (RTX 3060/4070). Merge it into a recipe:
--   wick.train(wick.preset("gpu_12gb", { model = model, data = data, optim = optim, batch_size = 32 }))
-- Trades less speed than gpu_8gb: bf16 autocast, and checkpointing every
-- second block only (half the recomputation of checkpointing every block, a
-- little under half its saving); the micro-batch is the largest that fits.
return {
  precision = "bf16-mixed",
  checkpointing = 2,
  micro_batch = "auto",
  on_oom = "split",
  workers = 2,
  prefetch = 2,
}
