-- wick's side of bench/media.sh: 16 uniform frames per clip, 224 x 224
-- (exact, bilinear), uint8 RGB; per clip on the training thread with one
-- decoding thread, and a loader epoch with 2 workers.
--   wick run bench/media.lua mode=clip|epoch manifest=FILE
local wick = require "wick"
local mode, manifest = wick.args.mode or "clip", wick.args.manifest
local d = wick.data("video_folder", { manifest = manifest, max_frames = 16, image_size = 224, resize = "exact",
  decode_threads = 1, time_limit = 0 })
local n = d:size()
if mode == "clip" then
  d:window(0, 1, 1):free()  -- warm up
  local best = math.huge
  for _ = 1, 3 do
    local t0 = wick.core.now()
    for i = 0, n - 1 do d:window(i, 1, 1):free() end
    best = math.min(best, wick.core.now() - t0)
  end
  print(wick.json { lib = "wick", frames_per_s = 16 * n / best, decoded_per_returned = d.frames_decoded / d.frames_returned })
else
  local loader = wick.loader(d, { micro_batch = 1, accumulate = 1, shuffle = false, workers = 2, prefetch = 2 })
  local t0 = wick.core.now()
  local got = 0
  loader:start_epoch(0, 0)
  while true do
    local w = loader:next()
    if not w then break end
    got = got + #w
    w:free()
  end
  print(wick.json { lib = "wick", frames_per_s = 16 * got / (wick.core.now() - t0) })
end
