-- `wick generate MODEL_DIR [prompt=... | messages=FILE|JSON|-] [max_new_tokens=N]
--  [temperature=T] [top_k=K] [top_p=P] [seed=S] [repetition_penalty=R]
--  [stop=TEXT|JSON list] [eos_id=E] [adapter=DIR] [tokenizer=PATH|bytes]`:
-- continues a prompt, or answers a chat, with a decoder_lm saved as a folder
-- (config.json + safetensors). The tokenizer is the folder's tokenizer.json,
-- or what `tokenizer` names (a tokenizer.json, a folder holding one, or
-- "bytes": UTF-8 bytes, as data "text" gives without a tokenizer); a folder
-- without one is an error (its ids would come out as bytes, text that means
-- nothing). `messages` (a JSON file, inline JSON, or - for stdin: a list of
-- {role, content}) is rendered through the tokenizer folder's chat template
-- with add_generation_prompt, and only the reply is written. Generation stops
-- after an end token: generation_config.json's eos ids (a chat model's
-- end-of-turn tokens), config.json's and the tokenizer's eos (eos_id=E: that
-- one alone, -1: none), or where the text reaches a stop string (not
-- written). Special tokens are not written. generation_config.json's
-- sampling settings (do_sample with temperature, top_k, top_p, and
-- repetition_penalty) are the defaults, as in transformers' generate.
-- `adapter` loads a LoRA adapter (PEFT's folder, or lora:save's) onto the
-- model first. The text is written
-- as the tokens come. Every other key is an option of model:generate, which
-- checks them all (an unknown key or a value out of range is an error naming
-- it); the prompt plus max_new_tokens must fit the model's context
-- (max_position_embeddings).
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

-- The chat, as JSON text, and how errors name it
local function messages_of(given)
  given = tostring(given)
  if given == "-" then return io.read("*a") or "", "generate: messages on stdin" end
  if given:match("^%s*[%[{]") then return given, "generate: messages (inline JSON)" end
  if core.list_dir(given) then
    error("generate: messages=" .. given .. " is a folder, expected a JSON file of [{\"role\", \"content\"}, ...], "
          .. "inline JSON, or - for stdin", 0)
  end
  local f = io.open(given, "rb")
  if not f then
    error("generate: messages=" .. given .. ": no such file, expected a JSON file of [{\"role\", \"content\"}, ...], "
          .. "inline JSON, or - for stdin", 0)
  end
  local text = f:read("*a")
  f:close()
  return text, "generate: messages=" .. given
end

-- stop=TEXT, or a JSON list of strings
local function stops_of(given)
  if given == nil then return {} end
  given = tostring(given)
  local list = { given }
  if given:match("^%s*%[") then
    local ok, v = pcall(core.json_decode, given)
    if not ok or type(v) ~= "table" then
      error("generate: stop=" .. given .. " is not a JSON list of strings, expected a string or a JSON list of "
            .. "strings", 0)
    end
    list = v
  end
  for i, s in ipairs(list) do
    if type(s) ~= "string" or s == "" then
      error("generate: stop: item " .. i .. " is " .. (s == "" and "empty" or core.json(s))
            .. ", expected a non-empty string", 0)
    end
  end
  return list
end

-- The ids generation stops after: generation_config.json's eos_token_id (one
-- or a list: a chat model's end-of-turn tokens), config.json's, the
-- tokenizer's eos_token; with none, the first of the usual end-of-text tokens
-- the tokenizer holds
-- generation_config.json's sampling settings, as transformers' generate
-- takes them from the folder (do_sample with temperature, top_k (50 when
-- absent) and top_p; repetition_penalty), each a number
local function defaults_of(dir)
  local path = dir .. "/generation_config.json"
  local f = io.open(path, "rb")
  if not f then return {}, path end
  local text = f:read("*a")
  f:close()
  local ok, gc = pcall(core.json_decode, text, path)
  if not ok then error("generate: " .. gc, 0) end
  if type(gc) ~= "table" then return {}, path end
  local function number(k)
    local v = gc[k]
    if v ~= nil and type(v) ~= "number" then
      error("generate: " .. path .. ": " .. k .. " is " .. core.json(v) .. ", expected a number", 0)
    end
    return v
  end
  local out = { repetition_penalty = number("repetition_penalty") }
  if gc.do_sample == true then
    out.temperature = number("temperature") or 1.0
    out.top_k = number("top_k") or 50
    out.top_p = number("top_p") or 1.0
  end
  if out.repetition_penalty == 1 then out.repetition_penalty = nil end
  return out, path
end

local function eos_ids_of(dir, tok)
  local ids, seen = {}, {}
  local function add(v)
    if type(v) == "number" and v >= 0 and not seen[v] then
      seen[v] = true
      ids[#ids + 1] = v
    elseif type(v) == "table" then
      for _, x in ipairs(v) do add(x) end
    end
  end
  for _, name in ipairs({ "generation_config.json", "config.json" }) do
    local f = io.open(dir .. "/" .. name, "rb")
    if f then
      local text = f:read("*a")
      f:close()
      local ok, j = pcall(core.json_decode, text, dir .. "/" .. name)
      if not ok then error("generate: " .. j, 0) end
      if type(j) == "table" then add(j.eos_token_id) end
    end
  end
  add(tok.eos_id)
  if #ids == 0 then
    for _, t in ipairs({ "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>" }) do
      local id = tok:token_id(t)
      if id then
        add(id)
        break
      end
    end
  end
  return ids
end

function M.main(dir)
  local a = wick.args
  local given, messages, stop, adapter, prompt = a.tokenizer, a.messages, a.stop, a.adapter, a.prompt
  for _, k in ipairs({ "tokenizer", "messages", "stop", "adapter", "prompt" }) do a[k] = nil end  -- not options of model:generate
  if messages ~= nil and prompt ~= nil then
    error("generate: both prompt= and messages= are given, expected one: a text to continue or a chat to answer", 0)
  end
  for k in pairs(a) do
    if k == "on_token" or k == "eos_ids" then
      error("generate: " .. k .. " is " .. (k == "on_token" and "a function" or "a list") .. " for model:generate in a "
            .. "recipe, not a command-line key", 0)
    end
  end
  local model
  -- a folder that is no model folder: the model's own error says what it lacks
  if not exists(dir .. "/config.json") then model = wick.model("decoder_lm", { path = dir }) end
  local tok = wick.tokenizer(tokenizer_of(dir, given))
  local stops = stops_of(stop)
  local ids, echo
  if messages ~= nil then
    local text, where = messages_of(messages)
    local ok, r = pcall(tok.apply_chat_template, tok, text, { add_generation_prompt = true, tokenize = true })
    if not ok then
      local why = tostring(r):gsub("^apply_chat_template: messages: ", ""):gsub("^apply_chat_template: ", "")
      error(where .. ": " .. why, 0)
    end
    ids, echo = r, ""
  else
    echo = tostring(prompt or "")
    ids = tok:encode(echo)
  end
  model = model or wick.model("decoder_lm", { path = dir })
  if adapter ~= nil then
    adapter = tostring(adapter)
    if not core.list_dir(adapter) then
      error("generate: adapter=" .. adapter .. ": no such folder, expected a LoRA adapter folder "
            .. "(adapter_config.json and adapter_model.safetensors, as PEFT's save_pretrained and lora:save write)", 0)
    end
    local lora = wick.optim("lora", {})
    local ok, err = pcall(lora.load, lora, model, adapter)
    if not ok then error("generate: adapter=" .. adapter .. ": " .. tostring(err), 0) end
  end
  local eos = eos_ids_of(dir, tok)
  if #ids == 0 then ids = { tok.bos_id or eos[1] or 0 } end
  local opts = { max_new_tokens = 64 }
  if a.eos_id == nil then
    opts.eos_ids = eos
  end
  -- the folder's generation settings, each replaced by a command-line key, said on stderr
  local defaults, gc_path = defaults_of(dir)
  local taken = {}
  for _, k in ipairs({ "temperature", "top_k", "top_p", "repetition_penalty" }) do
    if defaults[k] ~= nil and a[k] == nil then
      opts[k] = defaults[k]
      taken[#taken + 1] = k .. " " .. tostring(defaults[k])
    end
  end
  if #taken > 0 then
    io.stderr:write("wick: generate: from " .. gc_path .. ": " .. table.concat(taken, ", ")
                    .. " (a command-line key replaces each)\n")
  end
  for k, v in pairs(a) do opts[k] = v end
  -- Stream: the prompt with the first token (the options are checked before
  -- it), then after each token what the text gained since the last write,
  -- holding back a trailing U+FFFD (a character whose bytes have not all
  -- come) and a tail that may begin a stop string; at a stop string, the
  -- text before it, and the end.
  local out, shown, started, cut = {}, 0, false, false
  local function show(final)
    if not started then
      started = true
      io.write(echo)
    end
    local text = tok:decode(out, { skip_special_tokens = true })
    local upto = #text
    for _, s in ipairs(stops) do
      local at = text:find(s, 1, true)
      if at and at - 1 < upto then upto, cut = at - 1, true end
    end
    if not cut and not final then
      if text:sub(-3) == "\239\191\189" then upto = #text - 3 end
      for _, s in ipairs(stops) do
        for k = math.min(#s - 1, #text), 1, -1 do
          if text:sub(-k) == s:sub(1, k) then
            upto = math.min(upto, #text - k)
            break
          end
        end
      end
    end
    if upto > shown then
      io.write(text:sub(shown + 1, upto))
      shown = upto
    end
    io.stdout:flush()
  end
  opts.on_token = function(id)
    out[#out + 1] = id
    show(false)
    return cut
  end
  model:generate(ids, opts)
  if not cut then show(true) end
  io.write("\n")
end

return M
