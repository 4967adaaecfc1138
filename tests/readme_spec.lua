-- The manual against wick itself:
--  * the command table of docs/command-line.md and the plugin table of
--    docs/reference/plugins.md against what wick lists, both ways;
--  * every ```lua block of README.md and docs/**/*.md runs with `wick run`, at
--    small sizes: `max_steps=2` caps every wick.train call, and the block runs
--    in a folder where the names the examples use are tiny stand-ins made
--    here (a Hugging Face decoder folder "Qwen2.5-0.5B-Instruct" with a chat
--    template, data/*.jsonl, clips/ from `wick make-clips`, and tiny Hugging
--    Face folders written by wick.save_pretrained with the names the vision
--    pages use: hf/vit-base, hf/vit-small, hf/clip, clip-vit/, llama/).
-- A block that is a fragment (it continues the page's text: one option of a
-- wick.train call) is marked on the line before its fence:
--    <!-- fragment: why it does not run alone -->
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

-- The Markdown files of the manual, README.md first, relative to the source tree.
local function manual_files()
  local files = { "README.md" }
  local p = io.popen("cd " .. H.source .. " && find docs -name '*.md' | LC_ALL=C sort")
  for f in p:lines() do files[#files + 1] = f end
  p:close()
  return files
end

-- The rows of the Markdown table in `file` whose header line is `header`, each as a list of trimmed cells.
local function table_rows(file, header)
  local text = H.read(H.source .. "/" .. file)
  local rows, inside = {}, false
  for line in (text .. "\n"):gmatch("(.-)\n") do
    if line == header then
      inside = true
    elseif inside then
      if line:sub(1, 1) ~= "|" then break end
      if not line:match("^|%-") then
        local cells = {}
        for cell in line:sub(2):gsub("\\|", "\1"):gmatch("([^|]*)|") do
          cells[#cells + 1] = cell:gsub("\1", "|"):match("^%s*(.-)%s*$")
        end
        rows[#rows + 1] = cells
      end
    end
  end
  assert(inside, file .. " has no table headed '" .. header .. "'")
  return rows
end

-- Fails naming each key missing from `documented`, each one it has beyond
-- `listed`, and each that differs.
local function assert_same(what, listed, documented)
  local problems = {}
  for k, v in pairs(listed) do
    if documented[k] == nil then problems[#problems + 1] = "missing: " .. k
    elseif documented[k] ~= v then
      problems[#problems + 1] = k .. ": the page has '" .. documented[k] .. "', wick says '" .. v .. "'"
    end
  end
  for k in pairs(documented) do
    if listed[k] == nil then problems[#problems + 1] = "not in wick: " .. k end
  end
  table.sort(problems)
  assert(#problems == 0, what .. " table differs from wick:\n  " .. table.concat(problems, "\n  "))
end

describe("the manual's tables", function()
  it("docs/command-line.md has a row for every command `wick --help` lists, and no other", function()
    local _, help = H.run("--help")
    local listed, inside = {}, false
    for line in (help .. "\n"):gmatch("(.-)\n") do
      if line == "commands:" then inside = true
      elseif inside and line == "" then break
      elseif inside then
        local name = line:match("^  (%l[%w-]*)")
        if name then listed[name] = true end
      end
    end
    assert.truthy(listed.run and listed.plan, help)
    local documented = {}
    for _, cells in ipairs(table_rows("docs/command-line.md", "| command | what it does |")) do
      local name = cells[1]:match("^`wick (%l[%w-]*)")
      assert.truthy(name, "a command table row that does not start with `wick COMMAND: " .. cells[1])
      documented[name] = true
    end
    assert_same("docs/command-line.md's command", listed, documented)
  end)

  it("README.md opens with the two commands and stays a page (200 lines at most; the manual is docs/)", function()
    local readme = H.read(H.source .. "/README.md")
    local first = readme:match("^# wick\n\n```sh\n(.-)```\n")
    assert.truthy(first, "README.md should open with '# wick' and a sh block")
    assert.truthy(first:match("^scripts/demo ") and first:match("\nscripts/test "), "the opening block should be scripts/demo, then scripts/test:\n" .. first)
    local _, lines = readme:gsub("\n", "")
    assert.truthy(lines <= 200, "README.md has " .. lines .. " lines; move material into docs/")
  end)

  it("README.md's links into docs/ name pages (and headings) that exist", function()
    local readme = H.read(H.source .. "/README.md")
    local n = 0
    for target in readme:gmatch("%]%((docs/[^)]+)%)") do
      n = n + 1
      local file, anchor = target:match("^([^#]+)#?(.*)$")
      local text = H.read(H.source .. "/" .. file)
      assert.truthy(text ~= "", "README.md links to " .. file .. ", which does not exist")
      if anchor ~= "" then
        local found = false
        for heading in text:gmatch("\n#+ ([^\n]+)") do
          local slug = heading:lower():gsub("[^%w%s_-]", ""):gsub("%s+", "-")
          if slug == anchor then found = true end
        end
        assert.truthy(found, "README.md links to " .. target .. ": no such heading in " .. file)
      end
    end
    assert.truthy(n >= 10, "README.md has only " .. n .. " links into docs/")
  end)

  it("docs/reference/plugins.md has a row for every plugin `wick plugins --json` lists, with its kind and summary", function()
    local code, out, err = H.run("plugins --json", "WICK_PLUGIN_PATH=")
    assert.are.equal(0, code, err)
    local listed = {}
    for obj in out:gmatch("%b{}") do
      local name = assert(obj:match('"name":%s*"([^"]*)"'), obj)
      local kind = obj:match('"kind":%s*"([^"]*)"')
      assert.truthy(kind, "plugin " .. name .. " is unusable: " .. (obj:match('"error":%s*"([^"]*)"') or obj))
      if kind == "optim" then kind = kind .. "/" .. assert(obj:match('"makes":%s*"([^"]*)"'), obj) end
      listed[name] = kind .. " | " .. assert(obj:match('"summary":%s*"([^"]*)"'), obj)
    end
    assert.truthy(listed.mlp and listed.vlm and listed.qlora, out)
    local documented = {}
    for _, cells in ipairs(table_rows("docs/reference/plugins.md", "| plugin | kind | summary |")) do
      local name = cells[1]:match("^%[`([%w_]+)`%]")
      assert.truthy(name, "a plugin table row that does not start with [`name`](#name): " .. cells[1])
      documented[name] = cells[2] .. " | " .. cells[3]
    end
    assert_same("docs/reference/plugins.md's plugin", listed, documented)
  end)
end)

-- Every function of the running wick's `wick` table (wick.core's too) and every
-- method of its objects' metatables (wick.Model, wick.Data, ...), one a line.
local WALK = [[
local wick = require "wick"
local names, seen = {}, { [wick] = true }
local function walk(t, prefix)
  for k, v in pairs(t) do
    if type(k) == "string" and type(v) == "function" then names[#names + 1] = prefix .. k
    elseif type(k) == "string" and type(v) == "table" and k ~= "args" and not seen[v] then
      seen[v] = true
      walk(v, prefix .. k .. ".")
    end
  end
end
walk(wick, "wick.")
for name, mt in pairs(debug.getregistry()) do
  if type(name) == "string" and name:match("^wick%.%u") and type(mt) == "table" then
    local methods = type(mt.__index) == "table" and mt.__index or mt.methods
    for k, v in pairs(methods or {}) do
      if type(v) == "function" then names[#names + 1] = name .. ":" .. k end
    end
  end
end
table.sort(names)
print(table.concat(names, "\n"))
]]

describe("docs/reference/lua.md", function()
  it("has a heading for every function and object method of the running wick, and none beyond", function()
    local dir = H.tmpdir()
    local code, out, err = H.recipe(dir, "walk.lua", WALK)
    os.execute("rm -rf " .. dir)
    assert.are.equal(0, code, err)
    local listed = {}
    for name in out:gmatch("[^\n]+") do listed[name] = "" end
    assert.truthy(listed["wick.train"] and listed["wick.Model:save"] and listed["wick.core.predict"], out)
    -- "### wick.train(options)" names wick.train; under "## Model (wick.Model)",
    -- "### model:save(path)" names wick.Model:save
    local documented, section = {}, nil
    for line in (H.read(H.source .. "/docs/reference/lua.md") .. "\n"):gmatch("(.-)\n") do
      if line:match("^## ") then section = line:match("%((wick%.%u%w*)%)")
      elseif line:match("^### ") then
        local name = line:sub(5):gsub("`", ""):match("^([%w_.:]+)")
        if name and name:find(":") then
          assert.truthy(section, "a method heading outside an object's section: " .. line)
          name = section .. ":" .. name:match(":(.*)")
        end
        if name then documented[name] = "" end
      end
    end
    assert_same("docs/reference/lua.md's", listed, documented)
  end)
end)

-- Each ```lua block of a file: {line = the fence's line, code = ..., fragment = reason or nil}.
local function lua_blocks(file)
  local blocks, block, before = {}, nil, ""
  local n = 0
  for line in (H.read(H.source .. "/" .. file) .. "\n"):gmatch("(.-)\n") do
    n = n + 1
    if block then
      if line:match("^%s*```%s*$") then
        blocks[#blocks + 1] = block
        block = nil
      else
        block.code = block.code .. line .. "\n"
      end
    elseif line:match("^%s*```lua%s*$") then
      block = { line = n, code = "", fragment = before:match("^%s*<!%-%- fragment:?%s*(.-)%s*%-%->%s*$") }
    elseif line:match("%S") then
      before = line
    end
  end
  return blocks
end

local TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{% if m['role'] == 'assistant' %}"
  .. "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}"
  .. "\\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"

-- The stand-ins the examples name, in `dir`.
local FIXTURES = { "Qwen2.5-0.5B-Instruct", "data", "clips", "hf", "clip-vit", "llama" }

-- Tiny Hugging Face folders for the pages' vision examples, at the image and
-- patch sizes the examples give: a ViT at 224 and one at 112 (hf/vit-base,
-- hf/vit-small), a CLIPModel (hf/clip), a CLIP vision tower (clip-vit/) and a
-- LLaMA decoder (llama/).
local HF_FOLDERS = [[
local wick = require "wick"
local function tiny(more)
  local t = { hidden_size = 32, intermediate_size = 64, layers = 2, heads = 2 }
  for k, v in pairs(more) do t[k] = v end
  return t
end
wick.save_pretrained(wick.model("vit", tiny { image_size = 224, patch_size = 32 }), "hf/vit-base")
wick.save_pretrained(wick.model("vit", tiny { image_size = 112, patch_size = 16 }), "hf/vit-small")
wick.save_pretrained(wick.model("clip", tiny { image_size = 224, patch_size = 32, style = "clip", projection_dim = 16,
  text_hidden_size = 32, text_intermediate_size = 64, text_layers = 2, text_heads = 2 }), "hf/clip")
wick.save_pretrained(wick.model("vit", tiny { image_size = 224, patch_size = 32, style = "clip" }), "clip-vit")
wick.save_pretrained(wick.model("decoder_lm", tiny { vocab_size = 300 }), "llama")
]]
local function make_fixtures(dir)
  os.execute("mkdir -p " .. dir .. "/tok " .. dir .. "/data")
  H.write(dir .. "/tok/tokenizer.json", H.tokenizer_json())
  H.write(dir .. "/tok/tokenizer_config.json", '{"eos_token": "<|im_end|>", "chat_template": "' .. TEMPLATE .. '"}')
  local chat, text, sft = {}, {}, {}
  for i = 1, 16 do
    chat[#chat + 1] = string.format('{"messages": [{"role": "user", "content": "what is %d + %d?"}, '
      .. '{"role": "assistant", "content": "%d + %d is %d."}]}', i, i, i, i, 2 * i)
    text[#text + 1] = string.format('{"text": "document %d: the quick brown fox jumps over the lazy dog."}', i)
    sft[#sft + 1] = string.format('{"prompt": "count to %d:", "completion": " %s"}', i % 5 + 1,
      ("1 2 3 4 5"):sub(1, 2 * (i % 5 + 1) - 1))
  end
  H.write(dir .. "/data/chat.jsonl", table.concat(chat, "\n") .. "\n")
  H.write(dir .. "/data/held.jsonl", table.concat(chat, "\n", 1, 4) .. "\n")
  H.write(dir .. "/data/train.jsonl", table.concat(text, "\n") .. "\n")
  H.write(dir .. "/data/sft.jsonl", table.concat(sft, "\n") .. "\n")
  local code, out, err = H.recipe(dir, "make_model.lua", [[
local wick = require "wick"
local model = wick.model("decoder_lm", { vocab_size = 99, hidden_size = 32, intermediate_size = 64, layers = 2, heads = 2 })
wick.save_pretrained(model, "Qwen2.5-0.5B-Instruct", "tok")
]], "", "cd " .. dir .. " &&")
  assert(code == 0, "making the stand-in model folder failed:\n" .. out .. err)
  code, out, err = H.recipe(dir, "make_hf_folders.lua", HF_FOLDERS, "", "cd " .. dir .. " &&")
  assert(code == 0, "making the stand-in Hugging Face folders failed:\n" .. out .. err)
  code, out, err = H.run("make-clips " .. dir .. "/clips --per-class 2 --size 64x48 --seconds 0.2 --no-extras")
  assert(code == 0, "wick make-clips failed:\n" .. out .. err)
end

describe("every ```lua block of README.md and docs/", function()
  local dir = H.tmpdir()
  local made = false
  teardown(function() os.execute("rm -rf " .. dir) end)
  local count = 0
  for _, file in ipairs(manual_files()) do
    for _, b in ipairs(lua_blocks(file)) do
      count = count + 1
      local name = string.format("%s:%d", file, b.line)
      if b.fragment then
        pending(name .. " (a fragment: " .. b.fragment .. ")")
      else
        local id = count
        it(name .. " runs", function()
          if not made then
            make_fixtures(dir .. "/fixtures")
            made = true
          end
          local here = string.format("%s/block%d", dir, id)
          os.execute("mkdir -p " .. here)
          for _, f in ipairs(FIXTURES) do os.execute(string.format("ln -s ../fixtures/%s %s/%s", f, here, f)) end
          local code = b.code
          if not code:find('require%s*%(?%s*"wick"') then code = 'local wick = require "wick"\n' .. code end
          H.write(here .. "/block.lua", code)
          local rc, out, err = H.sh(string.format("cd %s && WICK_CACHE_DIR=%s/cache %s run block.lua max_steps=2",
            here, dir, H.wick))
          assert(rc == 0, string.format("%s: the block failed (exit %s):\n%s\n--- stdout\n%s\n--- stderr\n%s",
            name, tostring(rc), code, out:sub(-2000), err:sub(-3000)))
        end)
      end
    end
  end
  it("found the manual's blocks", function() assert.is_true(count >= 5, "only " .. count .. " ```lua blocks found") end)
end)
