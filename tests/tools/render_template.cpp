// Renders chat templates with wick's Jinja engine for tests/reference's
// comparisons with transformers and jinja2. Reads one JSON object on stdin,
//   {"template": "...", "contexts": [{...}, ...]}    variables as given, or
//   {"template": "...", "chats": [{"messages": [...], "tools": ..., "add_generation_prompt": ...,
//                                  "variables": {...}}, ...]}   as apply_chat_template
// and prints a JSON array with one result per context or chat:
//   {"text": "...", "spans": [[begin, end], ...]} (byte offsets) or {"error": "..."}.
// A template that does not parse gives one {"error": ...} each.
#include <iostream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "lib/jinja/jinja.hpp"

using nlohmann::ordered_json;

int main() {
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  ordered_json request = ordered_json::parse(input);
  bool chats = request.contains("chats");
  const ordered_json& items = chats ? request.at("chats") : request.at("contexts");
  ordered_json results = ordered_json::array();
  try {
    wick::jinja::ChatTemplate tpl(request.at("template").get<std::string>());
    for (const auto& item : items) {
      try {
        wick::jinja::RenderResult r;
        if (chats) {
          wick::jinja::ChatOptions options;
          options.tools = item.value("tools", ordered_json());
          options.add_generation_prompt = item.value("add_generation_prompt", false);
          options.variables = item.value("variables", ordered_json::object());
          r = tpl.apply(item.at("messages"), options);
        } else {
          r = tpl.render(item);
        }
        results.push_back({{"text", r.text}, {"spans", r.generation_spans}});
      } catch (const wick::jinja::TemplateError& e) {
        results.push_back({{"error", e.what()}});
      }
    }
  } catch (const wick::jinja::TemplateError& e) {
    for (std::size_t k = 0; k < items.size(); ++k) results.push_back({{"error", e.what()}});
  }
  std::cout << results.dump(-1, ' ', false, ordered_json::error_handler_t::replace) << "\n";
}
