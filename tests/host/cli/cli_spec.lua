-- The wick command line: commands, output, exit codes.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

-- The commands `wick --help` lists: the first word of each line under "commands:".
local function listed_commands()
  local _, out = H.run("--help")
  local names, inside = {}, false
  for line in (out .. "\n"):gmatch("(.-)\n") do
    if line == "commands:" then inside = true
    elseif inside and line == "" then break
    elseif inside then
      local name = line:match("^  (%l[%w-]*)")
      if name then names[#names + 1] = name end
    end
  end
  return names
end

local function starts_with(s, prefix) return s:sub(1, #prefix) == prefix end

describe("wick CLI", function()
  it("prints help and exits 0", function()
    local code, out = H.run("--help")
    assert.are.equal(0, code)
    assert.truthy(out:find("run RECIPE", 1, true))
    assert.truthy(out:find("describe NAME", 1, true))
  end)

  it("lists every command in its help", function()
    local names = listed_commands()
    table.sort(names)
    assert.are.same({ "describe", "generate", "launch", "make-clips", "plan", "plugins", "report", "run", "runs",
      "version" }, names)
  end)

  it("every command answers -h and --help on stdout with its own usage and exit 0", function()
    for _, name in ipairs(listed_commands()) do
      for _, flag in ipairs { "-h", "--help" } do
        local code, out, err = H.run(name .. " " .. flag)
        assert.are.equal(0, code, name .. " " .. flag .. ": " .. err)
        assert.truthy(starts_with(out, "usage: wick " .. name), name .. " " .. flag .. ":\n" .. out)
        assert.truthy(out:find("-h, --help", 1, true), out)
        assert.are.equal("", err, name .. " " .. flag)
      end
    end
    -- `wick help COMMAND` is the same text
    local _, direct = H.run("make-clips --help")
    local code, out = H.run("help make-clips")
    assert.are.equal(0, code)
    assert.are.equal(direct, out)
  end)

  it("an unknown flag is a usage error in every command: exit 2, the message, the command's usage", function()
    for _, name in ipairs(listed_commands()) do
      local code, out, err = H.run(name .. " --no-such-flag")
      assert.are.equal(2, code, name .. ": " .. err)
      assert.truthy(starts_with(err, "wick: error: unknown option '--no-such-flag' to " .. name .. "\n"), err)
      assert.truthy(err:find("\nusage: wick " .. name, 1, true), err)
      assert.are.equal("", out, name)
    end
  end)

  it("launch's usage errors exit 2 before any rank starts", function()
    local dir = H.tmpdir()
    local recipe = H.write(dir .. "/r.lua", "print('a rank ran')\n")
    for args, want in pairs {
      [recipe] = "--nproc-per-node is required",
      ["--nproc-per-node two " .. recipe] = "--nproc-per-node expects a whole number from 1 to 65535, not 'two'",
      ["--nproc-per-node 0 " .. recipe] = "--nproc-per-node expects a whole number from 1 to 65535, not '0'",
      ["--nproc-per-node 2"] = "a recipe is required",
      ["--nproc-per-node 2 --nnodes 2 " .. recipe] = "with several nodes, give every node the same --master-port",
      ["--nproc-per-node 2 --nnodes 2 --node-rank 2 --master-port 29511 " .. recipe] = "--node-rank 2 is not below --nnodes 2",
      ["--nproc-per-node 2 " .. recipe .. " oops"] = "argument 'oops' after the recipe is not key=value",
      ["--nproc_per_node=2 --standalone --master_port 29511 " .. recipe] = "--standalone is one node with its own rendezvous",
      ["--nproc_per_node=x " .. recipe] = "--nproc-per-node expects a whole number from 1 to 65535, not 'x'",
    } do
      local code, out, err = H.run("launch " .. args)
      assert.are.equal(2, code, args .. ": " .. err)
      assert.truthy(starts_with(err, "wick: error: " .. want), args .. ": " .. err)
      assert.truthy(err:find("\nusage: wick launch --nproc-per-node N", 1, true), err)
      assert.are.equal("", out, args)
    end
    os.execute("rm -rf " .. dir)
  end)

  it("a flag given without its value, or with a value it cannot take, exits 2 naming it", function()
    local code, _, err = H.run("plan r.lua --device-memory")
    assert.are.equal(2, code)
    assert.truthy(starts_with(err, "wick: error: --device-memory needs a value\n"), err)
    code, _, err = H.run("plugins --json=yes")
    assert.are.equal(2, code)
    assert.truthy(starts_with(err, "wick: error: --json is a flag and takes no value\n"), err)
    code, _, err = H.run("make-clips /nonexistent/x --classes 0x3")
    assert.are.equal(2, code)
    assert.truthy(starts_with(err, "wick: error: --classes expects a whole number from 1 to 6, not '0x3'\n"), err)
    code, _, err = H.run("make-clips /nonexistent/x --size 64x49")
    assert.are.equal(2, code)
    assert.truthy(err:find("--size expects WIDTHxHEIGHT, even numbers", 1, true), err)
  end)

  it("gives a recipe nan, inf and hex as the strings typed; numbers and booleans by their plain spelling", function()
    local dir = H.tmpdir()
    local code, out, err = H.recipe(dir, "args.lua", [[
local wick = require "wick"
for _, k in ipairs { "x", "y", "h", "j", "i", "n", "f", "e", "b" } do
  local v = wick.args[k]
  print(k, type(v), tostring(v))
end
]], "x=nan y=inf h=0x10 j=1e5x i=42 n=-7 f=0.5 e=3e-4 b=true")
    assert.are.equal(0, code, err)
    assert.are.equal(table.concat({
      "x\tstring\tnan", "y\tstring\tinf", "h\tstring\t0x10", "j\tstring\t1e5x", "i\tnumber\t42",
      "n\tnumber\t-7", "f\tnumber\t0.5", "e\tnumber\t0.0003", "b\tboolean\ttrue", "" }, "\n"), out)
    os.execute("rm -rf " .. dir)
  end)

  it("rejects an unknown command with usage and exit 2", function()
    local code, _, err = H.run("frobnicate")
    assert.are.equal(2, code)
    assert.truthy(err:find("unknown command 'frobnicate'", 1, true))
    assert.truthy(err:find("\nusage: wick <command>", 1, true), err)
  end)

  -- WICK_WITH_CUDA of the build that made $WICK (its CMakeCache.txt, beside bin/)
  local function built_with_cuda()
    local f = assert(io.open(H.wick:gsub("/bin/wick$", "") .. "/CMakeCache.txt"), "no CMakeCache.txt beside " .. H.wick)
    local cache = f:read("*a")
    f:close()
    return assert(cache:match("\nWICK_WITH_CUDA:BOOL=(%u+)"), "WICK_WITH_CUDA not in the CMake cache") == "ON"
  end

  it("reports versions of wick, LibTorch, CUDA and NCCL, as the build has them", function()
    local code, out = H.run("version")
    assert.are.equal(0, code)
    -- the LibTorch built against (the wheel's 2.11.0, or WICK_LIBTORCH's)
    assert.truthy(out:find("libtorch%s+%d+%.%d+%.%d+"), out)
    if built_with_cuda() then
      assert.truthy(out:find("nccl%s+%d+%.%d+"), out)
      assert.truthy(out:find("cuda_runtime%s+%d+%.%d+"), out)
      assert.truthy(out:find("cuda_usable"), out)
    else
      assert.truthy(out:find("nccl%s+not built"), out)
      assert.truthy(out:find("cuda_runtime%s+not built"), out)
      assert.truthy(out:find("cuda_usable%s+no %(built without CUDA%)"), out)
    end
  end)

  it("lists plugins, also as JSON", function()
    local code, out = H.run("plugins")
    assert.are.equal(0, code)
    for _, name in ipairs { "mlp", "decoder_lm", "synthetic", "tensors", "sgd", "adamw", "schedule" } do
      assert.truthy(out:find(name, 1, true), name)
    end
    code, out = H.run("plugins --json")
    assert.are.equal(0, code)
    assert.truthy(out:find('"name": "mlp"', 1, true))
    assert.truthy(out:find('"kind": "model"', 1, true))
  end)

  it("lists unusable plugins with the reason", function()
    local code, out = H.run("plugins", "WICK_PLUGIN_PATH=" .. H.test_plugins)
    assert.are.equal(0, code)
    assert.truthy(out:find("bad_abi.-ABI 999"))
    assert.truthy(out:find("bad_schema.-bad option schema"))
  end)

  it("describes a plugin's options with types, defaults and docs", function()
    local code, out = H.run("describe adamw")
    assert.are.equal(0, code)
    assert.truthy(out:find("betas%s+list of numbers%s+default {0%.9, 0%.999}"))
    assert.truthy(out:find("decoupled weight decay", 1, true))
  end)

  it("describes wick.train's options", function()
    local code, out = H.run("describe train")
    assert.are.equal(0, code)
    assert.truthy(out:find("accumulate", 1, true))
    assert.truthy(out:find("save_every", 1, true))
  end)

  it("describing an unknown plugin is an error listing the known ones", function()
    local code, _, err = H.run("describe nope")
    assert.are.equal(1, code)
    assert.truthy(err:find("unknown plugin 'nope' %(known plugins: adamw, adamw8bit, clip, decoder_lm, image_folder, lora, mlp"))
  end)

  it("requires key=value after the recipe", function()
    local dir = H.tmpdir()
    local code, _, err = H.recipe(dir, "r.lua", "", "oops")
    assert.are.equal(2, code)
    assert.truthy(err:find("'oops' after the recipe is not key=value", 1, true))
  end)

  it("names a missing recipe", function()
    local code, _, err = H.run("run /nonexistent/recipe.lua")
    assert.are.equal(1, code)
    assert.truthy(err:find("recipe /nonexistent/recipe.lua does not exist", 1, true))
  end)
  it("WICK_MEMORY_PEAK_TRACE=1 names where the tensors held at a step's peak were allocated", function()
    local dir = H.tmpdir()
    local text = [[
local wick = require 'wick'
local data = wick.data('synthetic', { size = 64, inputs = 32, classes = 4 })
local model = wick.model('mlp', { inputs = 32, hidden = { 512, 512 }, outputs = 4 })
wick.train { model = model, data = data, optim = wick.optim('adamw', { lr = 1e-3 }), micro_batch = 16, max_steps = 2,
  checkpointing = true }
]]
    local code, _, err = H.recipe(dir, "r.lua", text, "", "WICK_MEMORY_PEAK_TRACE=1")
    assert.are.equal(0, code, err)
    local total = err:match("wick: memory peak trace: ([%d.]+ %a+) held at the peak")
    assert.truthy(total, err)
    -- the biggest sites first, each with the frames that allocated it: the
    -- optimizer's moments are among them (AdamW's two per weight)
    assert.truthy(err:find("in %d+ block%(s%)"), err)
    assert.truthy(err:find("wick::Trainer::", 1, true), err)
    -- without the variable: nothing of it
    local code2, _, err2 = H.recipe(dir, "r.lua", text, "")
    assert.are.equal(0, code2, err2)
    assert.falsy(err2:find("memory peak trace", 1, true))
  end)
  it("a tool attached to the process still collects at its exit (LD_PRELOAD, CUDA_INJECTION64_PATH)", function()
    -- wick ends with std::_Exit, skipping the libraries' teardown (0.2 s a
    -- command), unless a profiler may write its data in its exit handlers:
    -- a preloaded library's destructor, as such a tool's, runs at exit() and
    -- not at _Exit. Without a tool (the fast end) the recipe's own unclosed
    -- file and printed lines are all there, and a failure's exit code kept.
    local dir = H.tmpdir()
    H.write(dir .. "/tool.c", [[
#include <stdio.h>
#include <stdlib.h>
__attribute__((destructor)) static void collect(void) {
  const char* p = getenv("TOOL_OUT");
  FILE* f = p ? fopen(p, "w") : NULL;
  if (f) { fputs("collected\n", f); fclose(f); }
}
]])
    local cc = H.sh("cc -shared -fPIC -o " .. dir .. "/tool.so " .. dir .. "/tool.c")
    assert.are.equal(0, cc)
    local text = "local wick = require 'wick'\n" ..
      "local f = assert(io.open(wick.args.out, 'w')); f:write('written by the recipe'); print('done')\n"
    local code, out, err = H.recipe(dir, "r.lua", text, "out=" .. dir .. "/mine.txt",
      "LD_PRELOAD=" .. dir .. "/tool.so TOOL_OUT=" .. dir .. "/collected.txt")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("done", 1, true), out)
    assert.are.equal("collected\n", H.read(dir .. "/collected.txt"))
    -- an unclosed file of the recipe's is complete either way, and the exit code kept
    assert.are.equal("written by the recipe", H.read(dir .. "/mine.txt"))
    os.remove(dir .. "/mine.txt")
    code, out, err = H.recipe(dir, "r.lua", text .. "error('failed on purpose')\n", "out=" .. dir .. "/mine.txt")
    assert.are.equal(1, code, err)
    assert.truthy(out:find("done", 1, true), out)
    assert.truthy(err:find("failed on purpose", 1, true), err)
    assert.are.equal("written by the recipe", H.read(dir .. "/mine.txt"))
    os.execute("rm -rf " .. dir)
  end)
end)
