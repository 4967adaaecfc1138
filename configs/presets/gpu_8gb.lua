-- Preset for 8 GB cards (RTX 3070/4060, T4 with fp16-mixed). Merge it into a recipe:
--   wick.train(wick.preset("gpu_8gb", { model = model, data = data, optim = optim, batch_size = 32 }))
-- Trades speed for memory: bf16 autocast halves activation memory (fp32 master
-- weights keep the result); checkpointing every block keeps only block inputs
-- and recomputes the rest in backward (about a third more compute), and
-- offload_activations keeps even those inputs in host memory, not on the card
-- (two copies over the bus a block and step, the same gradients); the
-- micro-batch is the largest that fits, with accumulate making up the batch
-- (more, smaller steps: slower, same result). On cards without bf16 (T4,
-- RTX 20xx) use precision = "fp16-mixed".
return {
  precision = "bf16-mixed",
  checkpointing = true,
  offload_activations = true,
  micro_batch = "auto",
  on_oom = "split",
  empty_cache_every = 0,
  workers = 2,
  prefetch = 2,
}
