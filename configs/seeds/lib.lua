-- The machinery the five seed recipes share (configs/seeds/00N_*.lua). Each
-- recipe is a table: the seed's own settings (micro-batch x accumulation,
-- precision, checkpointing, LoRA/QLoRA, sequence length, image size, frames,
-- clipping, empty-cache cadence), its model at two shapes (small: trains here
-- in seconds; real: the architecture the seed's project runs, with random
-- weights), and the seed's own memory figure. Running a recipe trains it:
--   wick run configs/seeds/000_microvlm.lua [clips=DIR] [shape=small|real] [epochs=N] [out=DIR] [heldout=DIR]
-- bench/seeds.lua measures each at its real shapes (one optimizer step).
local wick = require "wick"
local M = {}

-- The model options at a shape; `depth` (bench/seeds.lua) sets layer
-- options ({layers = 1, vision_layers = 2}) of the ones recipe.depth names.
function M.model_options(recipe, shape, data, depth)
  local o = {}
  for k, v in pairs(recipe.model[shape]) do o[k] = v end
  for k, v in pairs(recipe.model.common or {}) do if o[k] == nil then o[k] = v end end
  if recipe.model.from_data then recipe.model.from_data(o, data, shape) end
  for k, v in pairs(depth or {}) do o[k] = v end
  return o
end

-- The data set at a shape: media made by `wick make-clips DIR` (images or
-- clips with captions), or the captions as text.
function M.data(recipe, shape, clips)
  local d = recipe.data
  local o = {}
  for k, v in pairs(d.common or {}) do o[k] = v end
  for k, v in pairs(d[shape] or {}) do o[k] = v end
  local manifest = clips .. (d.kind == "clips" and "/manifest.csv" or "/images/manifest.csv")
  local f = io.open(manifest)
  if not f then
    error("no " .. manifest .. ": run `wick make-clips " .. clips .. (d.make and (" " .. d.make[shape]) or "") ..
      "` first (or give clips=DIR)", 0)
  end
  f:close()
  if d.kind == "text" then
    -- the captions of the still images, as JSONL text, repeated until they
    -- hold fill_bytes (enough sequences of the real length for a few steps)
    local lines, bytes = {}, 0
    local fill = o.fill_bytes or 0
    o.fill_bytes = nil
    repeat
      for line in io.lines(manifest) do
        local caption = line:match(",([^,]*)$")
        if caption and caption ~= "text" then
          lines[#lines + 1] = wick.core.json({ text = caption })
          bytes = bytes + #caption
        end
      end
    until bytes >= fill or #lines == 0
    local file = clips .. "/images/captions.jsonl"
    wick.core.write_file(file, table.concat(lines, "\n") .. "\n")
    o.file = file
    return wick.data("text", o)
  end
  o.manifest = manifest
  return wick.data(d.kind == "clips" and "video_folder" or "image_folder", o)
end

-- The wick.train table of a recipe at a shape (model, data, optimizer and
-- the seed's settings), with `extra` on top.
function M.train_table(recipe, shape, clips, extra, depth)
  local data = M.data(recipe, shape, clips)
  local model = wick.model(recipe.model.plugin, M.model_options(recipe, shape, data, depth))
  if recipe.transform then
    local t = wick.optim(recipe.transform[1], recipe.transform[2])
    t:apply(model)
  end
  -- what a shape trains beyond the seed's own choice (the small shapes'
  -- weights are random: a frozen random tower or head carries nothing a
  -- pretrained one would)
  for _, name in ipairs(recipe.unfreeze and recipe.unfreeze[shape] or {}) do model:unfreeze(name) end
  local oo = {}
  for k, v in pairs(recipe.optim[2]) do oo[k] = v end
  for k, v in pairs(recipe.optim[shape] or {}) do oo[k] = v end
  local t = { model = model, data = data, optim = wick.optim(recipe.optim[1], oo) }
  for k, v in pairs(recipe.train) do t[k] = v end
  for k, v in pairs(recipe.train_at and recipe.train_at[shape] or {}) do t[k] = v end
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

-- Does the model read the pictures? The loss on held-out media (`wick
-- make-clips` output in dir) with their own captions, and with the same
-- captions handed to other clips (rotated by half the list, so each lands on
-- another clip; the captions as a whole are the same). A model that ignores
-- the pictures scores both alike; the gap is what it reads from them, in nats
-- per token.
function M.heldout_manifests(recipe, dir)
  local d = recipe.data
  if d.kind == "text" then error("heldout=: seed " .. recipe.name .. " trains on text; it has no pictures to hold out", 0) end
  local manifest = dir .. (d.kind == "clips" and "/manifest.csv" or "/images/manifest.csv")
  local f = io.open(manifest)
  if not f then
    error("heldout=" .. dir .. ": no " .. manifest .. " (make held-out media with `wick make-clips " .. dir ..
      " --seed 7 " .. (d.make and d.make.small or "") .. "`)", 0)
  end
  local header = f:read("*l")
  if header ~= "path,label,text" then
    f:close()
    error(manifest .. ": expected the header path,label,text (wick make-clips' manifest), got " .. (header and ("'" .. header .. "'") or "an empty file"), 0)
  end
  local rows = {}
  for line in f:lines() do
    local path, label, text = line:match("^([^,]*),([^,]*),([^,]*)$")
    if not path then
      f:close()
      error(manifest .. ": expected rows of path,label,text, got '" .. line .. "'", 0)
    end
    rows[#rows + 1] = { path, label, text }
  end
  f:close()
  if #rows < 2 then error(manifest .. ": expected at least two clips to hand each other's captions, got " .. #rows, 0) end
  local out = { header }
  local half = math.floor(#rows / 2)
  for i, r in ipairs(rows) do out[#out + 1] = r[1] .. "," .. r[2] .. "," .. rows[(i - 1 + half) % #rows + 1][3] end
  local mismatched = manifest:match("^(.*)/[^/]*$") .. "/mismatched.csv"
  wick.core.write_file(mismatched, table.concat(out, "\n") .. "\n")
  return manifest, mismatched, #rows
end

function M.heldout(recipe, shape, dir, model)
  local d = recipe.data
  local manifest, mismatched, n = M.heldout_manifests(recipe, dir)
  local function eval(m)
    local o = {}
    for k, v in pairs(d.common or {}) do o[k] = v end
    for k, v in pairs(d[shape] or {}) do o[k] = v end
    o.manifest = m
    return wick.evaluate(model, wick.data(d.kind == "clips" and "video_folder" or "image_folder", o),
      { micro_batch = recipe.train.micro_batch }).loss
  end
  local own, other = eval(manifest), eval(mismatched)
  print(string.format("seed %s: held-out loss %.4f with their own captions, %.4f with others' (%d %s; the pictures are worth %.4f nats per token)",
    recipe.name, own, other, n, d.kind, other - own))
  return own, other
end

-- Running a recipe: bench/seeds.lua collects the table instead.
function M.main(recipe)
  local collect = rawget(_G, "wick_seed_collect")
  if collect then return collect(recipe) end
  local a = wick.args
  local shape = a.shape or "small"
  local heldout = a.heldout
  if heldout then M.heldout_manifests(recipe, heldout) end  -- refused now, not after the training
  if shape ~= "small" and shape ~= "real" then error("shape=" .. tostring(shape) .. ": expected small or real", 0) end
  local t = M.train_table(recipe, shape, a.clips or "clips",
    { out = a.out or ("runs/seeds/" .. recipe.name), epochs = recipe.epochs and recipe.epochs[shape] or 1 })
  local total, trainable = t.model:parameters()
  print(string.format("seed %s (%s), %s shapes: %d parameters, %d train; micro-batch %d x accumulate %d, %s",
    recipe.name, recipe.title, shape, total, trainable, t.micro_batch, t.accumulate, t.precision or "fp32"))
  local run = wick.train(t)
  print(string.format("seed %s: %d steps, first loss %.4f, final loss %.4f", recipe.name, run.steps,
    run.history[1] and run.history[1].loss or 0 / 0, run.final_loss or 0 / 0))
  if heldout then M.heldout(recipe, shape, heldout, t.model) end
  if recipe.check then recipe.check(t.model, t.data, run) end
  return run
end

return M
