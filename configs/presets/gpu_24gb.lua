-- Preset for 24 GB cards (RTX 3090/4090, A10). Merge it into a recipe:
--   wick.train(wick.preset("gpu_24gb", { model = model, data = data, optim = optim, batch_size = 64 }))
-- Trades almost nothing: bf16 autocast (faster and smaller on these cards) and
-- no checkpointing; if a micro-batch still does not fit, it is split and the
-- window redone (on_oom = "split"), with the same result.
return {
  precision = "bf16-mixed",
  checkpointing = false,
  micro_batch = "auto",
  on_oom = "split",
  workers = 4,
  prefetch = 4,
}
