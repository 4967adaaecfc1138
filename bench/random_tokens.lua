-- Shared by the benchmarks: a JSONL file of `count` pre-tokenized sequences
-- of `length` random byte tokens (0..255), for data `text`. Returns its path;
-- the caller removes it.
return function(count, length, seed)
  local file = os.tmpname()
  local f = assert(io.open(file, "w"))
  math.randomseed(seed or 1)
  for _ = 1, count do
    local ids = {}
    for i = 1, length do ids[i] = math.random(0, 255) end
    f:write('{"input_ids":[', table.concat(ids, ","), "]}\n")
  end
  f:close()
  return file
end
