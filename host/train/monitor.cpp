// The monitored evaluation metric: which evaluation is the best so far, and
// when patience runs out.

#include <cmath>

#include "observe/format.hpp"
#include "train/run_internal.hpp"
#include "train/run_options.hpp"
#include "wick/options.hpp"

namespace wick {

std::optional<Monitor> Monitor::of(const Options& o, const nlohmann::json& resume_state) {
  if (!o.has("monitor")) return std::nullopt;
  Monitor m;
  m.name = o.get_string("monitor");
  const bool loss = m.name.size() >= 4 && m.name.compare(m.name.size() - 4, 4, "loss") == 0;
  m.mode = o.has("monitor_mode") ? o.get_string("monitor_mode") : std::string(enum_name(kMonitorModeNames, !loss));
  m.keep_best = static_cast<int>(o.get_int("keep_best"));
  m.patience = o.get_int("patience");
  m.min_delta = o.get_number("min_delta");
  const auto e = resume_state.is_object() ? resume_state.value("extra", nlohmann::json::object()) : nlohmann::json::object();
  if (e.contains("monitor") && e["monitor"].value("name", "") == m.name && e["monitor"].value("mode", "") == m.mode &&
      e["monitor"].contains("best")) {
    m.best = e["monitor"]["best"].get<double>();
    m.best_step = e["monitor"].value("best_step", std::int64_t{0});
    m.bad = e["monitor"].value("bad_evals", std::int64_t{0});
  }
  return m;
}

double Monitor::value_in(const nlohmann::json& rec, const std::string& label) const {
  std::string key = name;
  if (!rec.contains(key) && key.rfind("eval_", 0) == 0) key = key.substr(5);
  if (!rec.contains(key) || !rec[key].is_number()) {
    std::string have;
    for (auto it = rec.begin(); it != rec.end(); ++it)
      if (it->is_number() && it.key() != "step" && it.key() != "items")
        have += (have.empty() ? "eval_" : ", eval_") + it.key();
    throw Error(label + ": option 'monitor': the evaluation has no metric '" + name + "' (it has " + have + ")");
  }
  return rec[key].get<double>();
}

void Monitor::record(double v, std::int64_t step) {
  const bool maximize = parse_enum(kMonitorModeNames, mode, "monitor_mode");
  const bool improved = std::isfinite(v) && (!best || (maximize ? v > *best + min_delta : v < *best - min_delta));
  if (improved) {
    best = v;
    best_step = step;
    bad = 0;
  } else {
    ++bad;
  }
}

std::string Monitor::patience_reason() const {
  return strf("%s did not improve on %.6g (step %lld) in %lld evaluations", name.c_str(), best ? *best : NAN,
              static_cast<long long>(best_step), static_cast<long long>(bad));
}

nlohmann::json Monitor::state(std::optional<double> value) const {
  nlohmann::json m = {{"name", name}, {"mode", mode}, {"bad_evals", bad}};
  if (value && std::isfinite(*value)) m["value"] = *value;
  if (best) m["best"] = *best, m["best_step"] = best_step;
  return m;
}

}  // namespace wick
