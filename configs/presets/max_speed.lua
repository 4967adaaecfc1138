-- Preset for speed when memory is plentiful. Merge it into a recipe:
--   wick.train(wick.preset("max_speed", { model = model, data = data, optim = optim, micro_batch = 64 }))
-- Trades memory for time: bf16 autocast, no checkpointing, no accumulation
-- split unless the recipe sets one, more loader threads and a deeper prefetch
-- queue (more batches held in host memory), gradients reduced once per window.
-- Out of memory stops the run rather than slowing it down (on_oom = "fail").
return {
  precision = "bf16-mixed",
  checkpointing = false,
  on_oom = "fail",
  workers = 4,
  prefetch = 8,
  sync = "window",
}
