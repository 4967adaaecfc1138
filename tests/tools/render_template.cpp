// Renders chat templates with wick's Jinja engine for tests/reference's
// comparison with transformers. Reads one JSON object on stdin,
//   {"template": "...", "contexts": [{...}, ...]}
// and prints a JSON array with one result per context:
//   {"text": "...", "spans": [[begin, end], ...]} (byte offsets) or {"error": "..."}.
// A template that does not parse gives one {"error": ...} per context.
#include <iostream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "lib/jinja/jinja.hpp"

int main() {
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  nlohmann::ordered_json request = nlohmann::ordered_json::parse(input);
  nlohmann::json results = nlohmann::json::array();
  const auto& contexts = request.at("contexts");
  try {
    wick::jinja::ChatTemplate tpl(request.at("template").get<std::string>());
    for (const auto& context : contexts) {
      try {
        auto r = tpl.render(context);
        results.push_back({{"text", r.text}, {"spans", r.generation_spans}});
      } catch (const wick::jinja::TemplateError& e) {
        results.push_back({{"error", e.what()}});
      }
    }
  } catch (const wick::jinja::TemplateError& e) {
    for (std::size_t k = 0; k < contexts.size(); ++k) results.push_back({{"error", e.what()}});
  }
  std::cout << results.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}
