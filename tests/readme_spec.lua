-- The README's command table and plugin table against what wick itself lists,
-- both ways, so that neither can drift from the code.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local readme = H.read(H.source .. "/README.md")

-- The rows of the Markdown table whose header line is `header`, each as a list of trimmed cells.
local function table_rows(header)
  local rows, inside = {}, false
  for line in (readme .. "\n"):gmatch("(.-)\n") do
    if line == header then
      inside = true
    elseif inside then
      if line:sub(1, 1) ~= "|" then break end
      if not line:match("^|%-") then
        local cells = {}
        for cell in line:sub(2):gmatch("([^|]*)|") do cells[#cells + 1] = cell:match("^%s*(.-)%s*$") end
        rows[#rows + 1] = cells
      end
    end
  end
  assert(inside, "README.md has no table headed '" .. header .. "'")
  return rows
end

-- Fails naming each key missing from `documented`, each one it has beyond
-- `listed`, and each that differs.
local function assert_same(what, listed, documented)
  local problems = {}
  for k, v in pairs(listed) do
    if documented[k] == nil then problems[#problems + 1] = "missing: " .. k
    elseif documented[k] ~= v then
      problems[#problems + 1] = k .. ": README has '" .. documented[k] .. "', wick says '" .. v .. "'"
    end
  end
  for k in pairs(documented) do
    if listed[k] == nil then problems[#problems + 1] = "not in wick: " .. k end
  end
  table.sort(problems)
  assert(#problems == 0, "README.md's " .. what .. " table differs from wick:\n  " .. table.concat(problems, "\n  "))
end

describe("README.md", function()
  it("has a row in its command table for every command `wick --help` lists, and no other", function()
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
    for _, cells in ipairs(table_rows("| command | what it does |")) do
      local name = cells[1]:match("^`wick (%l[%w-]*)")
      assert.truthy(name, "a command table row that does not start with `wick COMMAND: " .. cells[1])
      documented[name] = true
    end
    assert_same("command", listed, documented)
  end)

  it("has a row in its plugin table for every plugin `wick plugins --json` lists, with its kind and summary, and no other", function()
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
    for _, cells in ipairs(table_rows("| plugin | kind | summary |")) do
      local name = cells[1]:match("^`([%w_]+)`$")
      assert.truthy(name, "a plugin table row that does not start with `name`: " .. cells[1])
      documented[name] = cells[2] .. " | " .. cells[3]
    end
    assert_same("plugin", listed, documented)
  end)
end)
