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

return H
