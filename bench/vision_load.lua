-- One row of bench/vision_load.sh: makes a bf16 Hugging Face folder of CLIP
-- ViT-L/14's vision tower (303 M parameters, as the `vit` plugin saves it:
-- a CLIPVisionModel), or loads one in this process and prints the CPU
-- seconds of the load and the resident memory it added at its peak (VmHWM
-- less the resident memory before it) and after it:
--   wick run bench/vision_load.lua mode=make dir=D
--   wick run bench/vision_load.lua mode=load dir=D [dtype=bf16|fp32]
local wick = require "wick"
local a = wick.args
if a.mode == "make" then
  wick.seed(0)
  wick.save_pretrained(wick.model("vit", { style = "clip", image_size = 224, patch_size = 14, hidden_size = 1024,
    intermediate_size = 4096, layers = 24, heads = 16, dtype = "bf16" }), a.dir)
  return
end
assert(a.mode == "load", "mode: make or load")
-- the plugin library and LibTorch's own memory are in before the baseline
wick.model("vit", { image_size = 8, patch_size = 8, hidden_size = 8, intermediate_size = 8, layers = 1, heads = 2 })
collectgarbage()
local before = wick.memory(false).resident
local t0 = os.clock()
local model = wick.model("vit", { path = a.dir, dtype = a.dtype or "bf16" })
local cpu = os.clock() - t0
local m = wick.memory(false)
print(string.format("RESULT %.2f %d %d %d", cpu, m.peak_resident - before, m.resident - before, m.cpu_tensors))
