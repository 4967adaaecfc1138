// Chat data's rules without Lua or Python (plugins/lib/chat): transformers'
// assistant-mask loop over spans, the assistant turns of a template without
// {% generation %}, TRL's prompt masking, and the errors that name the row.
// tests/reference/test_chat_data.py checks the same against transformers.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../../../test_util.hpp"
#include "lib/chat/chat.hpp"

using ::testing::HasSubstr;
using nlohmann::ordered_json;

namespace {

constexpr std::int64_t I = -100;

// A folder with a character-level tokenizer.json (printable ASCII and "\n",
// ids 0..95, <|im_start|> 96, <|im_end|> 97) and `config` as tokenizer_config.json.
void write_folder(const std::filesystem::path& d, const ordered_json& config) {
  ordered_json vocab = ordered_json::object();
  vocab["\n"] = 0;
  for (int c = 32; c < 127; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 31;
  auto special = [](const char* s, int id) {
    return ordered_json{{"id", id}, {"content", s}, {"special", true}, {"normalized", false}, {"lstrip", false},
                        {"rstrip", false}, {"single_word", false}};
  };
  const ordered_json tok = {{"added_tokens", {special("<|im_start|>", 96), special("<|im_end|>", 97)}},
                            {"normalizer", nullptr}, {"pre_tokenizer", nullptr}, {"post_processor", nullptr},
                            {"decoder", {{"type", "Fuse"}}},
                            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", ordered_json::array()}}}};
  std::ofstream(d / "tokenizer.json") << tok.dump();
  std::ofstream(d / "tokenizer_config.json") << config.dump();
}

const char* kChatml =
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

std::vector<int> as_ints(const std::vector<bool>& marked) { return {marked.begin(), marked.end()}; }

}  // namespace

TEST(ChatData, SpanMaskFollowsTransformersAssistantMaskLoop) {
  wick::text::Encoding enc;
  enc.ids = {1, 2, 3, 4, 5};
  enc.offsets = {{0, 2}, {2, 4}, {4, 6}, {6, 8}, {8, 10}};
  const std::string text(10, 'x');
  // from the token holding the first byte to the one holding the last
  EXPECT_EQ(as_ints(wick::text::span_mask(enc, {{3, 7}}, text)), (std::vector<int>{0, 1, 1, 1, 0}));
  // an end in token 0 marks to the end (transformers' `end_token + 1 if end_token else len`)
  EXPECT_EQ(as_ints(wick::text::span_mask(enc, {{0, 1}}, text)), (std::vector<int>{1, 1, 1, 1, 1}));
  // a span starting where no token is ends the marking, later spans too
  EXPECT_EQ(as_ints(wick::text::span_mask(enc, {{2, 3}, {10, 11}, {8, 10}}, text)),
            (std::vector<int>{0, 1, 0, 0, 0}));
}

TEST(ChatData, AssistantTurnsOfATemplateWithoutGenerationCountAndNothingElse) {
  wick::test::TempDir dir;
  write_folder(dir.path, {{"eos_token", "<|im_end|>"}, {"chat_template", kChatml}});
  const wick::text::ChatFormat chat(dir.path.string());
  ASSERT_TRUE(chat.has_template());
  EXPECT_FALSE(chat.has_generation());
  auto tok = wick::text::bpe_tokenizer((dir.path / "tokenizer.json").string());
  const auto messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])");
  const auto t = wick::text::messages_tokens(chat, *tok, messages, /*assistant_only_loss=*/true, "d.jsonl:1");
  EXPECT_EQ(tok->decode(t.ids), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n");
  // the turn after "<|im_start|>assistant\n" (the generation prompt): its content, <|im_end|> and the newline
  std::vector<std::int64_t> counted;
  for (auto l : t.labels)
    if (l != I) counted.push_back(l);
  EXPECT_EQ(tok->decode(counted), "ok<|im_end|>\n");
}

TEST(ChatData, APromptAndCompletionMasksThePromptRenderedWithTheGenerationPrompt) {
  wick::test::TempDir dir;
  write_folder(dir.path, {{"chat_template", kChatml}});
  const wick::text::ChatFormat chat(dir.path.string());
  auto tok = wick::text::bpe_tokenizer((dir.path / "tokenizer.json").string());
  const auto t = wick::text::prompt_completion_tokens(chat, *tok, ordered_json::parse(R"([{"role": "user", "content": "hi"}])"),
                                                      ordered_json::parse(R"([{"role": "assistant", "content": "ok"}])"),
                                                      /*completion_only_loss=*/true, "d.jsonl:1");
  std::vector<std::int64_t> counted;
  for (auto l : t.labels)
    if (l != I) counted.push_back(l);
  EXPECT_EQ(tok->decode(counted), "ok<|im_end|>\n");
  EXPECT_FALSE(t.prompt_not_prefix);
}

TEST(ChatData, ATemplateThatRaisesIsNamedWithItsFileAndTheRow) {
  wick::test::TempDir dir;
  write_folder(dir.path, {{"chat_template", "{{ raise_exception('No system messages!') }}"}});
  const wick::text::ChatFormat chat(dir.path.string());
  auto tok = wick::text::bpe_tokenizer((dir.path / "tokenizer.json").string());
  try {
    wick::text::messages_tokens(chat, *tok, ordered_json::parse(R"([{"role": "system", "content": "x"}])"), true,
                                "data 'text': d.jsonl:3");
    FAIL() << "no error";
  } catch (const wick::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("data 'text': d.jsonl:3: the chat template " +
                                    (dir.path / "tokenizer_config.json").string() + " (line 1) failed: No system messages!"));
  }
}

TEST(ChatData, AFolderWithoutATemplateSaysWhatWasExpected) {
  wick::test::TempDir dir;
  write_folder(dir.path, {{"eos_token", "<|im_end|>"}});
  const wick::text::ChatFormat chat(dir.path.string());
  EXPECT_FALSE(chat.has_template());
  try {
    chat.missing("apply_chat_template");
    FAIL() << "no error";
  } catch (const wick::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("apply_chat_template needs a chat template, and the tokenizer folder " +
                                    dir.path.string() + " has none: expected chat_template.jinja or a \"chat_template\""));
  }
}
