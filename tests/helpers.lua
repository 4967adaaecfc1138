-- Helpers for the busted specs: run the wick executable and capture its output.
local H = {}

H.wick = assert(os.getenv("WICK"), "WICK must name the wick executable")
H.source = assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree")
H.test_plugins = os.getenv("WICK_TEST_PLUGIN_DIR")

local function read(path)
  local f = io.open(path, "rb")
  if not f then return "" end
  local s = f:read("*a")
  f:close()
  return s
end
H.read = read

function H.tmpdir()
  local p = io.popen("mktemp -d /tmp/wick-busted-XXXXXX")
  local d = p:read("*l")
  p:close()
  return d
end

function H.write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

-- Runs a shell command; returns exit code, stdout, stderr.
function H.sh(cmd)
  local dir = H.tmpdir()
  os.execute(string.format("(%s) > %s/out 2> %s/err < /dev/null; echo $? > %s/code", cmd, dir, dir, dir))
  local code = tonumber(read(dir .. "/code"))
  local out, err = read(dir .. "/out"), read(dir .. "/err")
  os.execute("rm -rf " .. dir)
  return code, out, err
end

-- Runs `wick ARGS` with optional environment assignments ("A=b C=d").
function H.run(args, env)
  return H.sh(string.format("%s %s %s", env or "", H.wick, args))
end

-- Writes a recipe into dir and runs it with `wick run`.
function H.recipe(dir, name, text, args, env)
  local path = H.write(dir .. "/" .. name, text)
  return H.run("run " .. path .. " " .. (args or ""), env)
end

-- A character-level tokenizer.json: printable ASCII and "\n" (ids 0..95),
-- one merge ("he", 96), <|im_start|> (97) and <|im_end|> (98) as special
-- tokens: a chat model folder's tokenizer small enough to write in a test.
function H.tokenizer_json()
  local vocab, id = {}, 0
  local function add(s)
    vocab[#vocab + 1] = string.format("%q: %d", s, id):gsub("\\\n", "\\n")
    id = id + 1
  end
  add("\n")
  for c = 32, 126 do add(string.char(c)) end
  add("he")
  return '{"version": "1.0", "added_tokens": ['
    .. '{"id": 97, "content": "<|im_start|>", "special": true, "normalized": false, "lstrip": false, "rstrip": false, "single_word": false},'
    .. '{"id": 98, "content": "<|im_end|>", "special": true, "normalized": false, "lstrip": false, "rstrip": false, "single_word": false}],'
    .. '"normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": {"type": "Fuse"},'
    .. '"model": {"type": "BPE", "vocab": {' .. table.concat(vocab, ", ") .. '}, "merges": ["h e"]}}'
end

return H
