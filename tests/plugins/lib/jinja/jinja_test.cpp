// The Jinja engine's own contract; its rendering of real chat templates is
// compared with transformers' in tests/reference/test_chat_templates.py, and
// one feature a template with jinja2 in test_jinja_vs_jinja2.py.
#include <gtest/gtest.h>

#include "lib/jinja/jinja.hpp"

using nlohmann::ordered_json;
using wick::jinja::ChatTemplate;
using wick::jinja::TemplateError;

namespace {

std::string render(const std::string& source, const ordered_json& context = ordered_json::object()) {
  return ChatTemplate(source).render(context).text;
}

std::string error_of(const std::string& source, const ordered_json& context = ordered_json::object()) {
  try {
    render(source, context);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Jinja, TrimsBlocksAndStripsTheirIndentation) {
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {% endif %}\nc"), "a\n  b\nc");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(render("  {{ 'x' }}\n"), "  x");  // a print keeps its indentation; one final newline goes
}

TEST(Jinja, LoopsSeeTheirLoopVariable) {
  ordered_json ctx = {{"xs", {"a", "b", "c"}}};
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index0 }}{{ x }}{{ '|' if not loop.last }}{% endfor %}", ctx),
            "0a|1b|2c");
  EXPECT_EQ(render("{% for x in xs %}{% if x == 'b' %}{% break %}{% endif %}{{ x }}{% endfor %}", ctx), "a");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
}

TEST(Jinja, LoopAssignmentsStayInTheLoopAndNamespacesCarryThemOut) {
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [2, 3] %}{% set x = i %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in [2, 3] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"),
            "6");
}

TEST(Jinja, UndefinedPrintsNothingAndFailsOnAttributes) {
  EXPECT_EQ(render("[{{ nope }}]{{ nope is defined }}{{ nope | default('d') }}"), "[]Falsed");
  EXPECT_EQ(error_of("{{ nope.x }}"), "'nope' is undefined");
  EXPECT_EQ(error_of("{{ m.x.y }}", {{"m", ordered_json::object()}}), "'dict object' has no attribute 'x'");
}

TEST(Jinja, RaiseExceptionCarriesItsMessageVerbatim) {
  EXPECT_EQ(error_of("{{ raise_exception('Roles must alternate: ' ~ 2) }}"), "Roles must alternate: 2");
}

TEST(Jinja, SyntaxErrorsNameTheLineAndWhatWasExpected) {
  EXPECT_EQ(error_of("a\n{% for x in y %}\nb"),
            "line 3: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. "
            "The innermost block that needs to be closed is 'for'.");
  try {
    ChatTemplate("\n\n{{ 1 + }}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line(), 3);
  }
}

TEST(Jinja, ToJsonIsPythonsJsonDumps) {
  ordered_json ctx = {{"v", ordered_json::parse(R"({"b": [1, 2.5, null, true], "a": "é\"\n"})")}};
  EXPECT_EQ(render("{{ v | tojson }}", ctx), R"({"b": [1, 2.5, null, true], "a": "é\"\n"})");
  EXPECT_EQ(render("{{ v.b | tojson(indent=2) }}", ctx), "[\n  1,\n  2.5,\n  null,\n  true\n]");
}

TEST(Jinja, KeepsTheContextsKeyOrder) {
  ordered_json ctx = ordered_json::parse(R"({"d": {"z": 1, "a": 2}})");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}", ctx), "z1a2");
}

TEST(Jinja, SlicesAndIndexesStringsByCodePoint) {
  ordered_json ctx = {{"s", "naïve"}, {"xs", {1, 2, 3}}};
  EXPECT_EQ(render("{{ s[2] }}{{ s[1:4] }}{{ s | length }}{{ xs[::-1] }}{{ xs[1:] }}", ctx), "ïaïv5[3, 2, 1][2, 3]");
}

TEST(Jinja, GenerationBlocksReportTheirByteSpans) {
  ChatTemplate tpl("{% for m in messages %}<{{ m }}>{% generation %}{{ m | upper }}!{% endgeneration %}{% endfor %}");
  auto r = tpl.render(ordered_json{{"messages", {"é", "b"}}});
  EXPECT_EQ(r.text, "<é>É!<b>B!");
  ASSERT_EQ(r.generation_spans.size(), 2u);
  EXPECT_EQ(r.text.substr(r.generation_spans[0].first, r.generation_spans[0].second - r.generation_spans[0].first),
            "É!");
  EXPECT_EQ(r.generation_spans[1], std::make_pair(std::size_t(10), std::size_t(12)));
}

TEST(Jinja, MacrosRenderWithTheirArguments) {
  EXPECT_EQ(render("{% macro f(a, b='!') %}{{ a }}{{ b }}{% endmacro %}{{ f('x') }}{{ f('y', b='?') }}"), "x!y?");
}

TEST(Jinja, TheSandboxRefusesMutation) {
  EXPECT_EQ(error_of("{{ xs.append(1) }}", {{"xs", ordered_json::array()}}),
            "access to attribute 'append' of 'list' object is unsafe.");
}

TEST(Jinja, RunawayRecursionAndNestingAreErrorsNotCrashes) {
  EXPECT_EQ(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), "maximum recursion depth exceeded");
  EXPECT_EQ(error_of("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
            "line 1: expressions nested too deeply");
  std::string blocks;
  for (int k = 0; k < 3000; ++k) blocks += "{% if true %}";
  EXPECT_EQ(error_of(blocks), "line 1: blocks nested too deeply");
}

TEST(Jinja, ApplyPassesWhatApplyChatTemplatePasses) {
  ChatTemplate tpl(
      "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}[{{ m.reasoning_content }}|{{ m.thinking }}]"
      "{% endfor %}{{ tools is none }}{{ documents is none }}{% if add_generation_prompt %}>{% endif %}");
  auto messages = ordered_json::parse(R"([{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a", "reasoning": "r"}])");
  wick::jinja::ChatOptions options;
  options.add_generation_prompt = true;
  options.variables = {{"bos_token", "<s>"}};
  EXPECT_EQ(tpl.apply(messages, options).text, "<s>user:q[|]assistant:a[r|r]TrueTrue>");
}

TEST(Jinja, RuntimeErrorsCarryTheirLine) {
  try {
    render("a\n{% if true %}\n{{ raise_exception('no') }}{% endif %}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_STREQ(e.what(), "no");
    EXPECT_EQ(e.line(), 3);
  }
}

TEST(Jinja, IntegersFailRatherThanOverflow) {
  EXPECT_EQ(render("{{ 2 ** 62 }} {{ (-1) ** 1000000000001 }}"), "4611686018427387904 -1");
  EXPECT_EQ(error_of("{{ 2 ** 64 }}"), "integer overflow: the result does not fit in 64 bits");
  EXPECT_EQ(error_of("{{ 9223372036854775807 + 1 }}"), "integer overflow: the result does not fit in 64 bits");
  EXPECT_EQ(error_of("{{ 'ab' * 1000000000000 }}"), "repetition too large: over 256 MiB");
}
