-- `wick generate MODEL_DIR [prompt=...] [max_new_tokens=N] [temperature=T]
--  [top_k=K] [top_p=P] [seed=S] [eos_id=E]`: continues a prompt with a
-- decoder_lm saved as a folder (config.json + safetensors, tokenizer.json
-- beside them or bytes). The text is written as the tokens come. Every key
-- but prompt is an option of model:generate, which checks them all (an
-- unknown key or a value out of range is an error naming it); prompt plus
-- max_new_tokens must fit the model's context (max_position_embeddings).
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
  local opts = { max_new_tokens = 64, eos_id = data.eos_id }
  for k, v in pairs(a) do
    if k == "on_token" then error("generate: on_token is a function for model:generate in a recipe, " ..
                                  "not a command-line key", 0) end
    if k ~= "prompt" then opts[k] = v end
  end
  -- Stream: the prompt with the first token (the options are checked before
  -- it), then after each token what the text gained since the last write,
  -- holding back a trailing U+FFFD (a character whose bytes have not all come).
  local out, shown, started = {}, 0, false
  local function show(final)
    if not started then
      started = true
      io.write(prompt)
    end
    local text = data:decode(out)
    if (final or text:sub(-3) ~= "\239\191\189") and #text > shown then
      io.write(text:sub(shown + 1))
      shown = #text
    end
    io.stdout:flush()
  end
  opts.on_token = function(id)
    out[#out + 1] = id
    show(false)
  end
  model:generate(ids, opts)
  show(true)
  io.write("\n")
end

return M
