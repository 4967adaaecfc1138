-- wick.tokenizer(DIR_OR_FILE): encode and decode with transformers' flags,
-- apply_chat_template returning the rendered text or its ids, data "text"
-- over messages rows (the rendered conversation, no end of text added), and bad calls
-- refused in one line naming the call. (Token ids against transformers'
-- are tests/reference/test_chat_data.py's.)
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()
teardown(function() os.execute("rm -rf " .. dir) end)

local TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{% if m['role'] == 'assistant' %}"
  .. "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}"
  .. "\\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{{ greeting }}{% endif %}"

os.execute("mkdir -p " .. dir .. "/m")
H.write(dir .. "/m/tokenizer.json", H.tokenizer_json())
H.write(dir .. "/m/tokenizer_config.json", '{"eos_token": "<|im_end|>", "chat_template": "' .. TEMPLATE .. '"}')

local head = 'local wick = require "wick"\nlocal tok = wick.tokenizer("' .. dir .. '/m")\n'
  .. 'local chat = { { role = "user", content = "hi" }, { role = "assistant", content = "hello" } }\n'

describe("wick.tokenizer", function()
  it("encodes and decodes with add_special_tokens and skip_special_tokens", function()
    local code, out, err = H.recipe(dir, "e.lua", head .. [[
local ids = tok:encode("<|im_start|>he")
print("ids", table.concat(ids, " "))
print("plain", #tok:encode("he", { add_special_tokens = false }))
print("text", tok:decode(ids))
print("skipped", tok:decode(ids, { skip_special_tokens = true }))
]])
    assert.are.equal(0, code, err)
    assert.truthy(out:find("ids\t97 96\n", 1, true), out)
    assert.truthy(out:find("plain\t1\n", 1, true), out)
    assert.truthy(out:find("text\t<|im_start|>he\n", 1, true), out)
    assert.truthy(out:find("skipped\the\n", 1, true), out)
  end)

  it("applies the folder's chat template: the text, or its ids, with the generation prompt and extra variables", function()
    local code, out, err = H.recipe(dir, "c.lua", head .. [[
local text = tok:apply_chat_template(chat, { tokenize = false })
io.write("text[", text, "]\n")
local ids = tok:apply_chat_template(chat)
print("same ids", table.concat(ids, " ") == table.concat(tok:encode(text, { add_special_tokens = false }), " "))
io.write("prompt[", tok:apply_chat_template({ chat[1] }, { tokenize = false, add_generation_prompt = true,
                                                           greeting = "Sure:" }), "]\n")
]])
    assert.are.equal(0, code, err)
    -- trim_blocks: the newline after {% endif %} goes, as in jinja2
    assert.truthy(out:find("text[<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nhello<|im_end|>]", 1, true), out)
    assert.truthy(out:find("same ids\ttrue", 1, true), out)
    assert.truthy(out:find("prompt[<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nSure:]", 1, true), out)
  end)

  it("continues the final message and returns the assistant tokens' mask, as transformers names them", function()
    local code, out, err = H.recipe(dir, "m.lua", head .. [[
io.write("cont[", tok:apply_chat_template(chat, { tokenize = false, continue_final_message = true }), "]\n")
local d = tok:apply_chat_template(chat, { return_assistant_tokens_mask = true })
print("ids", table.concat(d.input_ids, " ") == table.concat(tok:apply_chat_template(chat), " "))
print("mask", table.concat(d.assistant_masks, ""))
print("attention", #d.attention_mask == #d.input_ids)
local plain = tok:apply_chat_template(chat, { return_dict = true })
print("plain", plain.assistant_masks == nil, #plain.input_ids == #d.input_ids)
]])
    assert.are.equal(0, code, err)
    -- the render stops after the final message's text: no <|im_end|> to close it
    assert.truthy(out:find("cont[<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nhello]", 1, true), out)
    assert.truthy(out:find("ids\ttrue", 1, true), out)
    -- <|im_start|> u s e r \n h i <|im_end|> <|im_start|> a s s i s t a n t \n: 20 tokens outside the
    -- {% generation %} block, then "he" "l" "l" "o" <|im_end|> inside it
    assert.truthy(out:find("mask\t0000000000000000000011111\n", 1, true), out)
    assert.truthy(out:find("attention\ttrue", 1, true), out)
    assert.truthy(out:find("plain\ttrue\ttrue", 1, true), out)
  end)

  it("takes a tokenizer.json too, and data text renders messages rows through the template", function()
    H.write(dir .. "/d.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    local code, out, err = H.recipe(dir, "d.lua", [[
local wick = require "wick"
local tok = wick.tokenizer("]] .. dir .. [[/m/tokenizer.json")
print("ids", #tok:encode("hello"))
for _, only in ipairs { true, false } do
  local data = wick.data("text", { file = "]] .. dir .. [[/d.jsonl", tokenizer = "]] .. dir .. [[/m",
                                   cache_dir = "none", assistant_only_loss = only })
  print("eos", data.eos_id)
  local n = #tok:apply_chat_template({ { role = "user", content = "hi" }, { role = "assistant", content = "hello" } })
  print("tokens", only, data.tokens == n)
end
]])
    assert.are.equal(0, code, err)
    assert.truthy(out:find("ids\t4\n", 1, true), out)  -- h e merged
    -- none of <|endoftext|>, </s>, ...: tokenizer_config.json's eos_token pads batches
    assert.truthy(out:find("eos\t98\n", 1, true), out)
    -- the rendered conversation's tokens, with no end-of-text added: the template ends the turns
    assert.truthy(out:find("tokens\ttrue\ttrue", 1, true), out)
    assert.truthy(out:find("tokens\tfalse\ttrue", 1, true), out)
  end)

  it("trains a decoder on messages rows", function()
    local rows = {}
    for i = 1, 8 do
      rows[i] = '{"messages": [{"role": "user", "content": "q' .. i .. '"}, {"role": "assistant", "content": "a' .. i .. '"}]}'
    end
    H.write(dir .. "/t.jsonl", table.concat(rows, "\n") .. "\n")
    local code, out, err = H.recipe(dir, "t.lua", [[
local wick = require "wick"
local data = wick.data("text", { file = "]] .. dir .. [[/t.jsonl", tokenizer = "]] .. dir .. [[/m", cache_dir = "none" })
local model = wick.model("decoder_lm", { vocab_size = data.vocab_size, hidden_size = 16, layers = 1, heads = 2,
  intermediate_size = 32 })
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4,
  quiet = true }
print("steps", run.steps, run.final_loss == run.final_loss)
]])
    assert.are.equal(0, code, err)
    assert.truthy(out:find("steps\t2\ttrue", 1, true), out)
  end)

  for _, case in ipairs {
    { "wick.tokenizer(42)", "bad argument #1 to 'tokenizer' (string expected, got number)" },
    { "tok:decode({ 1 }, { skip_special_tokens = 1 })", "'skip_special_tokens' must be a boolean, got number" },
    { "tok:apply_chat_template('hi')", "apply_chat_template: messages: not valid JSON" },
    { "tok:apply_chat_template({ { content = 'x' } })", "apply_chat_template: messages[0].role: expected a string (system, user, assistant, ...), got nothing" },
    { "tok:apply_chat_template(chat, { add_generation_prompt = 'yes' })", "apply_chat_template: option 'add_generation_prompt': expected a boolean, got \"yes\"" },
  } do
    it("refuses " .. case[1], function()
      local code, _, err = H.recipe(dir, "bad.lua", head .. case[1] .. "\n")
      assert.are.equal(1, code, err)
      assert.truthy(err:find(case[2], 1, true), err)
      assert.falsy(err:find("traceback", 1, true), err)
    end)
  end
end)
