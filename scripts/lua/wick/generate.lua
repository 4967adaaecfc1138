-- `wick generate MODEL_DIR [prompt=...] [max_new_tokens=N] [temperature=T]
--  [top_k=K] [top_p=P] [seed=S] [eos_id=E] [tokenizer=PATH|bytes]`: continues
-- a prompt with a decoder_lm saved as a folder (config.json + safetensors).
-- The tokenizer is the folder's tokenizer.json, or what `tokenizer` names (a
-- tokenizer.json, a folder holding one, or "bytes": UTF-8 bytes, as data
-- "text" gives without a tokenizer); a folder without one is an error (its
-- ids would come out as bytes, text that means nothing). The text is written
-- as the tokens come. Every other key but prompt is an option of
-- model:generate, which checks them all (an unknown key or a value out of
-- range is an error naming it); prompt plus max_new_tokens must fit the
-- model's context (max_position_embeddings).
local wick = require "wick"
local core = wick.core

local M = {}

local function exists(path)
  local f = io.open(path)
  if f then f:close() end
  return f ~= nil
end

-- Files of tokenizers that wick does not read (it reads tokenizer.json)
local OTHER_TOKENIZER_FILES = { "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                                "merges.txt", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json" }

-- The tokenizer of a model folder: `tokenizer=` as given (bytes, a
-- tokenizer.json, a folder holding one), else DIR/tokenizer.json; none is an
-- error saying what to do.
local function tokenizer_of(dir, given)
  if given ~= nil then
    given = tostring(given)
    if given == "bytes" then return "bytes" end
    if core.list_dir(given) then
      if not exists(given .. "/tokenizer.json") then
        error("generate: tokenizer=" .. given .. " is a folder without a tokenizer.json, expected a tokenizer.json "
              .. "file, a folder holding one, or bytes", 0)
      end
      return given .. "/tokenizer.json"
    end
    if not exists(given) then
      error("generate: tokenizer=" .. given .. ": no such file, expected a tokenizer.json file, a folder holding "
            .. "one, or bytes", 0)
    end
    return given
  end
  if exists(dir .. "/tokenizer.json") then return dir .. "/tokenizer.json" end
  local others = {}
  for _, name in ipairs(OTHER_TOKENIZER_FILES) do
    if exists(dir .. "/" .. name) then others[#others + 1] = name end
  end
  error("generate: the model folder " .. dir .. " has no tokenizer.json"
        .. (#others > 0 and (" (it holds " .. table.concat(others, ", ") .. ", which wick does not read: it reads "
                             .. "the tokenizer.json that Hugging Face's tokenizers library saves)")
                         or " and no other tokenizer files")
        .. ", so the ids the model makes cannot be turned into text: pass tokenizer=PATH (a tokenizer.json, or a "
        .. "folder holding one), or tokenizer=bytes for a model trained on UTF-8 bytes (data \"text\" without a "
        .. "tokenizer), or save the tokenizer with the model (wick.save_pretrained(model, dir, tokenizer_json))", 0)
end

function M.main(dir)
  local a = wick.args
  local given = a.tokenizer
  a.tokenizer = nil  -- not an option of model:generate
  local model
  -- a folder that is no model folder: the model's own error says what it lacks
  if not exists(dir .. "/config.json") then model = wick.model("decoder_lm", { path = dir }) end
  local tokenizer_json = tokenizer_of(dir, given)
  local ok, data = pcall(wick.tokenizer, tokenizer_json)
  if not ok then error(data, 0) end
  model = model or wick.model("decoder_lm", { path = dir })
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
