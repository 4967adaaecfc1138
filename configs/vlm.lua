-- A LLaVA-style vision-language model learns to caption wick's toy images
-- ("a red circle"), in the usual stages, each its own wick.train call with
-- its own memory settings:
--   0. the parts a real run downloads, made here unless vision=DIR and
--      language=DIR give them: a vision tower (a ViT that learned to tell the
--      shapes apart, saved as a Hugging Face ViT folder) and a language model
--      that learned the captions' language (decoder_lm, saved the same way);
--   1. the projector alone learns to map the vision tower's tokens into the
--      language model (vision tower and language model frozen);
--   2. LoRA on the language model, the projector still training
--      (lora's modules_to_save), with activation checkpointing, bf16 autocast
--      and gradient accumulation.
-- It ends by captioning held-out images and scoring the shape word.
--   wick make-clips clips --per-class 512 --size 96x96 --seconds 0.2 --no-extras
--   wick run configs/vlm.lua [clips=clips] [vision=CLIP_DIR] [language=LLAMA_DIR] [epochs=N] [out=runs/vlm]
--                            [overwrite=true]
-- Each stage reads these itself (overrides = false): out=DIR is the recipe's
-- folder, and each stage trains into a folder of its own inside it.
local wick = require "wick"
local a = wick.args
local root = a.clips or "clips"
local out = a.out or "runs/vlm"
local epochs = tonumber(a.epochs or 12)
-- bf16 autocast where the hardware has bf16 arithmetic (CUDA); CPUs without it
-- run bf16 several times slower than fp32, so there fp32 unless precision=bf16-mixed
local precision = a.precision or (wick.device():find("^cuda") and "bf16-mixed" or "fp32")

-- held-out images: every 8th row of the manifest
local f = io.open(root .. "/images/manifest.csv")
if not f then error("no " .. root .. "/images/manifest.csv: run `wick make-clips " .. root .. "` first (or give clips=DIR)", 0) end
local header = f:read("*l")
local train_rows, test_rows, n = {}, {}, 0
for line in f:lines() do
  if line ~= "" then
    local t = (n % 8 == 0) and test_rows or train_rows
    t[#t + 1] = line
    n = n + 1
  end
end
f:close()
local function write(name, rows)
  wick.core.write_file(root .. "/images/" .. name, header .. "\n" .. table.concat(rows, "\n") .. "\n")
  return root .. "/images/" .. name
end
local size = tonumber(a.image_size) or 48
local function images(manifest)
  return wick.data("image_folder", { manifest = manifest, image_size = size, resize = "exact", tokenizer = "bytes",
    prompt = "<image>", text_length = 32 })
end
local train, test = images(write("vlm_train.csv", train_rows)), images(write("vlm_test.csv", test_rows))
print(string.format("%d training images, %d held out", train:size(), test:size()))

-- 0. the language model
local language = a.language
local lm_sizes = { vocab_size = train.vocab_size, hidden_size = 96, intermediate_size = 192, layers = 2, heads = 4 }
if not language then
  local lines = {}
  for _, row in ipairs(train_rows) do
    local caption = row:match(",([^,]*)$")
    lines[#lines + 1] = wick.core.json({ text = caption })
  end
  wick.core.mkdirs(out)
  wick.core.write_file(out .. "/captions.jsonl", table.concat(lines, "\n") .. "\n")
  local lm = wick.model("decoder_lm", lm_sizes)
  wick.seed(1)
  local r = wick.train { model = lm, data = wick.data("text", { file = out .. "/captions.jsonl", max_length = 32, cache_dir = "none" }),
    optim = wick.optim("adamw", { lr = 3e-3, weight_decay = 0 }), micro_batch = 32, epochs = epochs, quiet = true, seed = 1, overrides = false }
  language = out .. "/language_model"
  wick.save_pretrained(lm, language)
  print(string.format("stage 0: language model on the captions, loss %.3f", r.final_loss))
end

-- 0. the vision tower: a small ViT trained to name the shapes (the labels of the same training images)
local vision = a.vision
if not vision then
  local shapes = wick.data("image_folder", { manifest = root .. "/images/vlm_train.csv", image_size = size,
    resize = "exact", flip = true })
  local vit = wick.model("vit", { classes = shapes.num_classes, image_size = size, patch_size = 8, hidden_size = 64,
    intermediate_size = 128, layers = 2, heads = 4 })
  wick.seed(1)
  local r = wick.train { model = vit, data = shapes, optim = wick.optim("adamw", { lr = 1e-3, weight_decay = 0 }),
    micro_batch = 16, epochs = tonumber(a.vision_epochs or a.epochs or 20), quiet = true, seed = 1,
    overrides = false }
  vision = out .. "/vision_tower"
  wick.save_pretrained(vit, vision)
  print(string.format("stage 0: vision tower on the shapes, loss %.3f", r.final_loss))
end

-- the model: vision tower, projector, language model
local opts = { vision_path = vision, language_path = language, image_token_id = train.image_token_id,
  projector = "mlp2x_gelu", freeze_vision = true, freeze_language = true, vision_feature_layer = -1 }
wick.seed(1)
local model = wick.model("vlm", opts)
local total, trainable = model:parameters()
local function caption_accuracy(show)
  local right = 0
  for i = 0, test:size() - 1 do
    local w = test:window(i, 1)
    local text = test:decode(model:generate(w, { max_new_tokens = 24, eos_id = test.eos_id }))
    local want = test_rows[i + 1]:match(",([^,]*)$")
    local shape = want:match("(%a+)$")
    if text:find(shape, 1, true) then right = right + 1 end
    if show and i < 6 then print(string.format("  %-22s -> %s", want, text)) end
    w:free()
  end
  return right / test:size()
end

-- 1. the projector alone: small and cheap, large micro-batches, fp32
print(string.format("stage 1: projector alone (%d of %d parameters train)", trainable, total))
local r1 = wick.train { model = model, data = train, optim = wick.optim("adamw", { lr = 3e-3, weight_decay = 0 }),
  micro_batch = 32, epochs = epochs, out = out .. "/stage1", quiet = true, seed = 1, overrides = false,
  overwrite = a.overwrite or false }
print(string.format("stage 1: loss %.3f, held-out shape accuracy %.0f%%", r1.final_loss, 100 * caption_accuracy(false)))

-- 2. LoRA on the language model, the projector kept training; checkpointing,
-- bf16 autocast (on CUDA) and accumulation, as a larger model would need
local lora = wick.optim("lora", { r = 8, alpha = 16, target_modules = { "all-linear" },
  modules_to_save = { "multi_modal_projector" } })
lora:apply(model)
total, trainable = model:parameters()
print(string.format("stage 2: LoRA on %d layers + projector (%d of %d parameters train)", lora.layers, trainable, total))
local r2 = wick.train { model = model, data = train, optim = wick.optim("adamw", { lr = 2e-3, weight_decay = 0 }),
  micro_batch = 8, accumulate = 4, precision = precision, checkpointing = true, epochs = epochs,
  out = out .. "/stage2", quiet = true, seed = 2, overrides = false, overwrite = a.overwrite or false }
lora:save(model, out .. "/adapter")
print(string.format("stage 2: loss %.3f, peak memory %.0f MB", r2.final_loss, (tonumber(r2.peak_memory) or 0) / 2^20))
print("held-out captions:")
local acc = caption_accuracy(true)
print(string.format("shape accuracy on %d held-out images: %.0f%% (adapter and projector in %s/adapter)",
  test:size(), 100 * acc, out))
