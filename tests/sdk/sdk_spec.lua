-- The plugin contract as a recipe meets it: capabilities a model lacks are
-- named, the version has one source.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()

teardown(function() os.execute("rm -rf " .. dir) end)

describe("the SDK contract", function()
  it("a model without a capability says which, where a recipe asks for it", function()
    local pre = "local wick = require 'wick'\nlocal m = wick.model('mlp', { inputs = 4, outputs = 2 })\n"
    local code, _, err = H.recipe(dir, "g.lua", pre .. "m:generate({ 1, 2 })\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("g.lua:3: this model does not implement generate()", 1, true), err)
    code, _, err = H.recipe(dir, "l.lua", pre .. "wick.optim('lora', { r = 2 }):apply(m)\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("l.lua:3: optim 'lora': the model offers no linear layers for adapters", 1, true), err)
    -- a model with the capability answers through it
    code, _, err = H.recipe(dir, "p.lua", "local wick = require 'wick'\n" ..
      "local m = wick.model('decoder_lm', { vocab_size = 16, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2 })\n" ..
      "print(#m:generate({ 1, 2 }, { max_new_tokens = 3 }))\n")
    assert.are.equal(0, code, err)
  end)

  it("wick version reports the project's version, from its one source", function()
    local project = H.read(H.source .. "/CMakeLists.txt"):match("project%(wick VERSION ([%d%.]+)")
    assert.truthy(project)
    local code, out = H.run("version")
    assert.are.equal(0, code)
    assert.truthy(out:find("wick%s+" .. project:gsub("%.", "%%.") .. "\n"), out)
    local abi = H.read(H.source .. "/sdk/wick/plugin.hpp"):match("#define WICK_ABI_VERSION (%d+)")
    assert.truthy(abi)
    assert.truthy(out:find("plugin_abi%s+" .. abi .. "\n"), out)
    -- the plugin authors' page names the same ABI
    local page = H.read(H.source .. "/docs/plugins/index.md"):match("Plugin ABI%s+(%d+)")
    assert.are.equal(abi, page)
  end)
end)
