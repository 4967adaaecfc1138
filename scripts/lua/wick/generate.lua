-- `wick generate MODEL_DIR [prompt=...] [max_new_tokens=N] [temperature=T]
--  [top_k=K] [top_p=P] [seed=S]`: continues a prompt with a decoder_lm saved
-- as a folder (config.json + safetensors, tokenizer.json beside them or bytes).
local wick = require "wick"
local core = wick.core

local M = {}

function M.main(dir)
  local a = wick.args
  local tokenizer_json = dir .. "/tokenizer.json"
  local f = io.open(tokenizer_json)
  if f then f:close() else tokenizer_json = "bytes" end
  -- the tokenizer comes with a text data set; a one-line probe file feeds it
  local probe = os.tmpname()
  core.write_file(probe, "x")
  local ok, data = pcall(wick.data, "text", { files = { probe }, tokenizer = tokenizer_json })
  os.remove(probe)
  if not ok then error(data, 0) end
  local model = wick.model("decoder_lm", { path = dir })
  local prompt = tostring(a.prompt or "")
  local ids = data:encode(prompt)
  if #ids == 0 then ids = { data.eos_id } end
  local out = model:generate(ids, {
    max_new_tokens = a.max_new_tokens or 64, temperature = a.temperature or 0, top_k = a.top_k or 0,
    top_p = a.top_p or 1, seed = a.seed or 0, eos_id = data.eos_id,
  })
  io.write(prompt, data:decode(out), "\n")
end

return M
