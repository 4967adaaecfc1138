// LoRA adapters on a model's linear layers (Hu et al.), shared by optim
// `lora` and optim `qlora`: y = W x + (alpha / r) B A dropout(x), the base
// frozen, A and B trained. Adapters save and load as PEFT does
// (adapter_model.safetensors with base_model.model.<module>.lora_{A,B}.weight,
// adapter_config.json) and can be merged into the base weights.
// modules_to_save (PEFT's option) keeps whole modules trainable beside the
// adapters (a VLM's projector, a new head) and saves them with the adapter as
// PEFT does: base_model.model.<module>.<parameter>.
// With Base::Nf4 (`qlora`, Dettmers et al.) the adapted layers' base weights
// are stored as 4-bit NF4 with double-quantized block constants
// (wick/kit/nf4.hpp), dequantized to compute_dtype per product.

#include "lib/lora/adapters.hpp"

#include <wick/kit/linear.hpp>
#include <wick/model.hpp>
#include <wick/optim.hpp>
#include <wick/kit/json_fields.hpp>
#include <wick/kit/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "base_model.model.";

class Lora : public wick::Transform {
 public:
  Lora(const wick::Options& o, wick::lora::Base base)
      : nf4_(base == wick::lora::Base::Nf4),
        name_(nf4_ ? "optim 'qlora'" : "optim 'lora'"),
        r_(o.get_int("r")),
        alpha_(o.get_number("alpha")),
        dropout_(o.get_number("dropout")) {
    for (const auto& t : o.at("target_modules").as_list()) targets_.push_back(t.as_string());
    bias_ = o.get_string("bias");
    for (const auto& t : o.at("modules_to_save").as_list()) save_modules_.push_back(t.as_string());
    compile_patterns();
    if (nf4_) {
      const std::string c = o.get_string("compute_dtype");
      compute_ = c == "fp32" ? at::kFloat : c == "fp16" ? at::kHalf : at::kBFloat16;
      block_given_ = o.has("block_size");
      if (block_given_) block_ = o.get_int("block_size");
    }
  }

  // "re:PATTERN" entries match whole module names as regular expressions
  // (PEFT's string form); the others are names or name suffixes.
  void compile_patterns() {
    patterns_.clear();
    for (const auto& t : targets_)
      if (t.rfind("re:", 0) == 0) {
        try {
          patterns_.emplace_back(t.substr(3), std::regex::ECMAScript);
        } catch (const std::regex_error& e) {
          throw wick::Error(std::string(name_) + ": target_modules: '" + t + "' is not a valid regular expression: " + e.what());
        }
      }
  }

  bool matches(const std::string& name) const {
    for (const auto& re : patterns_)
      if (std::regex_match(name, re)) return true;
    for (const auto& t : targets_)
      if (t == "all-linear" || name == t || (name.size() > t.size() && name.ends_with("." + t))) return true;
    return false;
  }

  // The biases `bias` trains: "all" every bias of the model, "lora_only" those
  // of the adapted layers, "none" none (PEFT's choices).
  std::vector<std::pair<std::string, at::Tensor>> trained_biases(wick::Model& model) const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    if (bias_ == "none") return out;
    std::set<std::string> adapted_names(applied_.begin(), applied_.end());
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      const std::string& n = p.key();
      if (!(n == "bias" || n.ends_with(".bias"))) continue;
      const std::string owner = n.size() > 5 ? n.substr(0, n.size() - 5) : "";
      if (bias_ == "all" || adapted_names.count(owner)) out.emplace_back(n, p.value());
    }
    return out;
  }

  // The parameters of modules_to_save: those of a module whose name is an
  // entry or ends with "." + entry (PEFT's rule), or starts with the entry.
  std::vector<std::pair<std::string, at::Tensor>> saved_modules(wick::Model& model) const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    if (save_modules_.empty()) return out;
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      const std::string& n = p.key();
      bool hit = false;
      for (std::size_t dot = n.find('.'); dot != std::string::npos && !hit; dot = n.find('.', dot + 1)) {
        const std::string m = n.substr(0, dot);
        for (const auto& e : save_modules_)
          if (m == e || (m.size() > e.size() && m.ends_with("." + e))) hit = true;
      }
      // an adapter's own weights stay the adapter's, trained biases are saved as such
      if (hit && n.find(".lora_A.") == std::string::npos && n.find(".lora_B.") == std::string::npos)
        out.emplace_back(n, p.value());
    }
    std::set<std::string> biases;
    for (auto& [n, b] : trained_biases(model)) biases.insert(n);
    std::erase_if(out, [&](const auto& x) { return biases.count(x.first) > 0; });
    return out;
  }

  void apply(wick::Model& model) override {
    if (!applied_.empty()) throw wick::Error(std::string(name_) + ": already applied to a model");
    auto* targets = wick::capability<wick::AdapterTargets>(model);
    auto layers = targets ? targets->linear_layers() : std::vector<std::pair<std::string, wick::Linear>>{};
    if (layers.empty()) throw wick::Error(std::string(name_) + ": the model offers no linear layers for adapters");
    for (auto& p : model.parameters()) p.set_requires_grad(false);
    for (auto& [name, lin] : layers)
      if (matches(name)) {
        if (nf4_ && lin->quantized()) {
          // quantized while loading (a model's quantize = "nf4"): kept as it is, not quantized twice
          if (block_given_ && lin->nf4_block() != block_)
            throw wick::Error("optim 'qlora': layer " + name + " was quantized on load in blocks of " +
                              std::to_string(lin->nf4_block()) + " (the model's quantize_block), block_size is " +
                              std::to_string(block_) + ", expected the same block size (or block_size left out)");
          base_params_ += lin->in_features * lin->out_features;
          // its float weight never existed: counted at the compute dtype's size
          float_bytes_ += lin->in_features * lin->out_features * static_cast<std::int64_t>(c10::elementSize(compute_));
          lin->set_compute_dtype(compute_);
          base_bytes_ += lin->weight_bytes();
        } else if (nf4_) {
          const std::int64_t count = lin->in_features * lin->out_features;
          if (count % block_ != 0)
            throw wick::Error("optim 'qlora': layer " + name + " has " + std::to_string(count) +
                              " weights, not a multiple of block_size " + std::to_string(block_));
          if (count % 2 != 0)  // an odd block_size lets an odd count through the check above
            throw wick::Error("optim 'qlora': layer " + name + " has " + std::to_string(count) +
                              " weights, an odd count, expected an even one (two 4-bit values share a byte; an even "
                              "block_size makes every count even)");
          base_params_ += lin->in_features * lin->out_features;
          float_bytes_ += lin->weight_bytes();
          lin->quantize_nf4(compute_, block_);
          base_bytes_ += lin->weight_bytes();
        }
        lin->add_adapter(r_, alpha_, dropout_);
        applied_.push_back(name);
      }
    for (auto& [n, b] : trained_biases(model)) b.set_requires_grad(true);
    if (!save_modules_.empty()) {
      auto kept = saved_modules(model);
      if (kept.empty()) {
        std::string all;
        for (const auto& c : model.named_children()) all += (all.empty() ? "" : ", ") + c.key();
        throw wick::Error(std::string(name_) + ": modules_to_save matched no module of the model (its top-level "
                          "modules: " + all + ")");
      }
      for (auto& [n, t] : kept) t.set_requires_grad(true);
    }
    if (applied_.empty()) {
      std::string all;
      for (std::size_t i = 0; i < layers.size() && i < 8; ++i) all += (i ? ", " : "") + layers[i].first;
      throw wick::Error(std::string(name_) + ": target_modules matched none of the model's linear layers (" + all + ", ...)");
    }
  }

  std::vector<std::pair<std::string, wick::Linear>> adapted(wick::Model& model) const {
    std::set<std::string> names(applied_.begin(), applied_.end());
    std::vector<std::pair<std::string, wick::Linear>> out;
    auto* targets = wick::capability<wick::AdapterTargets>(model);
    if (!targets) throw wick::Error(std::string(name_) + ": the model offers no linear layers for adapters");
    for (auto& [name, lin] : targets->linear_layers())
      if (names.count(name) && lin->has_adapter()) out.emplace_back(name, lin);
    return out;
  }

  void save(wick::Model& model, const std::string& dir) const override {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (auto& [name, lin] : adapted(model)) {
      tensors.emplace_back(kPrefix + name + ".lora_A.weight", lin->lora_A->weight);
      tensors.emplace_back(kPrefix + name + ".lora_B.weight", lin->lora_B->weight);
    }
    // PEFT's names: an adapted layer's bias is its base layer's
    std::set<std::string> adapted_names(applied_.begin(), applied_.end());
    for (auto& [n, b] : trained_biases(model)) {
      const std::string owner = n.substr(0, n.size() - 5);
      tensors.emplace_back(kPrefix + (adapted_names.count(owner) ? owner + ".base_layer.bias" : n), b);
    }
    for (auto& [n, t] : saved_modules(model)) tensors.emplace_back(kPrefix + n, t);
    if (tensors.empty()) throw wick::Error(std::string(name_) + ": no adapters to save (apply it to the model first)");
    fs::create_directories(dir);
    wick::write_safetensors(fs::path(dir) / "adapter_model.safetensors", tensors, {{"format", "pt"}});
    nlohmann::json cfg = {{"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"r", r_}, {"lora_alpha", alpha_},
                          {"lora_dropout", dropout_}, {"target_modules", peft_targets()}, {"bias", bias_},
                          {"fan_in_fan_out", false}, {"inference_mode", false}, {"use_rslora", false},
                          {"modules_to_save", save_modules_.empty() ? nlohmann::json(nullptr) : nlohmann::json(save_modules_)},
                          {"base_model_name_or_path", nullptr}};
    wick::write_file_atomic(fs::path(dir) / "adapter_config.json", cfg.dump(2) + "\n");
  }

  void load(wick::Model& model, const std::string& dir) override {
    const fs::path cfg_file = fs::path(dir) / "adapter_config.json";
    if (!fs::exists(cfg_file)) throw wick::Error(std::string(name_) + ": " + dir + " has no adapter_config.json");
    const nlohmann::json json = wick::read_json_file(cfg_file);
    const wick::JsonFields cfg(json, std::string(name_) + ": " + cfg_file.string());
    check_supported(cfg, dir);
    adopt_or_match(model, read_settings(cfg), cfg);
    const std::string weights_file = (fs::path(dir) / "adapter_model.safetensors").string();
    const std::map<std::string, at::Tensor> given = read_adapter_tensors(weights_file);
    at::NoGradGuard no_grad;
    std::size_t used = load_adapter_weights(model, given, dir, weights_file, cfg_file.string());
    used += load_trained_tensors(model, given, dir);
    if (used != given.size())
      throw wick::Error(std::string(name_) + ": " + dir + " holds " + std::to_string(given.size() - used) +
                        " tensors for layers the model has no adapter on");
  }

 private:
  // An adapter_config.json's settings this adapter has fields for.
  struct Settings {
    std::int64_t r = 0;
    double alpha = 0;
    std::vector<std::string> targets, save_modules;
    std::string bias;
  };

  // Refuses what wick's LoRA does not compute as PEFT would.
  void check_supported(const wick::JsonFields& cfg, const std::string& dir) const {
    if (cfg.string("peft_type", "LORA") != "LORA")
      throw wick::Error(std::string(name_) + ": " + dir + " holds a " + cfg.string("peft_type") + " adapter, not LORA");
    if (cfg.flag("use_rslora", false) || cfg.flag("use_dora", false))
      throw wick::Error(std::string(name_) + ": rsLoRA and DoRA adapters are not supported yet");
    for (const char* key : {"rank_pattern", "alpha_pattern"})
      if (cfg.has(key) && !(cfg.json()[key].is_object() && cfg.json()[key].empty()))
        cfg.bad(key, "{} (a rank or alpha per module is not supported yet)");
    // LoraConfig fields that change which layers carry an adapter or what one
    // computes: set, the adapter would load onto other layers (or without its
    // extra weights) and fail naming a tensor, or load and compute otherwise.
    // Unset is PEFT's default: null, false, or empty (0 is a layer index).
    static const std::pair<const char*, const char*> changes[] = {
        {"layers_to_transform", "adapters on only some layers"},
        {"layers_pattern", "adapters on only some layers"},
        {"exclude_modules", "modules left out of target_modules"},
        {"lora_bias", "a bias on lora_B"},
        {"fan_in_fan_out", "weights stored transposed (Conv1D)"},
        {"use_qalora", "QALoRA"},
        {"alora_invocation_tokens", "activated LoRA"},
        {"layer_replication", "replicated layers"},
        {"target_parameters", "adapters on parameters"},
        {"trainable_token_indices", "trainable token embeddings"},
        {"use_bdlora", "block-diagonal LoRA"},
        {"arrow_config", "Arrow routing"},
        {"megatron_config", "Megatron layers"}};
    for (const auto& [key, what] : changes) {
      const nlohmann::json* v = cfg.find(key);
      if (!v || (v->is_boolean() && !v->get<bool>()) || ((v->is_array() || v->is_object()) && v->empty()) ||
          (v->is_string() && v->get<std::string>().empty()))
        continue;
      cfg.bad(key, std::string(v->is_boolean() ? "false" : "null") + " (" + what + ": not supported)");
    }
  }

  static Settings read_settings(const wick::JsonFields& cfg) {
    const nlohmann::json& json = cfg.json();
    Settings s;
    s.r = cfg.integer("r", 1);
    s.alpha = cfg.number("lora_alpha", 0.0, 0);
    if (!cfg.has("lora_alpha")) cfg.bad("lora_alpha", "a number");
    // PEFT: a string is a regular expression over whole names, a list holds names
    if (cfg.has("target_modules") && json["target_modules"].is_string()) {
      s.targets.push_back("re:" + json["target_modules"].get<std::string>());
    } else {
      for (const auto& t : cfg.array("target_modules")) {
        if (!t.is_string()) cfg.bad("target_modules", "a list of module names or one regular expression");
        s.targets.push_back(t.get<std::string>());
      }
    }
    if (cfg.has("modules_to_save"))
      for (const auto& m : cfg.array("modules_to_save")) {
        if (!m.is_string()) cfg.bad("modules_to_save", "a list of module names");
        s.save_modules.push_back(m.get<std::string>());
      }
    s.bias = cfg.string("bias", "none");
    if (s.bias != "none" && s.bias != "all" && s.bias != "lora_only") cfg.bad("bias", "none, all or lora_only");
    return s;
  }

  // A model without adapters takes the saved settings and gets its adapters;
  // one with them must have been made with the same r and alpha (the
  // adapters on the model scale by their own alpha / r).
  void adopt_or_match(wick::Model& model, const Settings& s, const wick::JsonFields& cfg) {
    if (applied_.empty()) {
      r_ = s.r;
      alpha_ = s.alpha;
      targets_ = s.targets;
      bias_ = s.bias;
      save_modules_ = s.save_modules;
      compile_patterns();
      apply(model);
    } else if (s.r != r_ || s.alpha != alpha_) {
      const bool r_differs = s.r != r_;
      cfg.fail(r_differs ? "r" : "lora_alpha",
               "is " + (r_differs ? std::to_string(s.r) : wick::json_brief(cfg.json()["lora_alpha"])) +
                   ", the adapters already on the model have " +
                   (r_differs ? "r " + std::to_string(r_) : "alpha " + wick::json_brief(nlohmann::json(alpha_))) +
                   ", expected the adapter saved with the same settings");
    }
  }

  // The file's tensors by the model's names: PEFT's prefix, ".default" and
  // ".base_layer" taken out.
  static std::map<std::string, at::Tensor> read_adapter_tensors(const std::string& weights_file) {
    auto file = wick::read_safetensors(weights_file);
    std::map<std::string, at::Tensor> given;
    for (auto& [name, t] : file.tensors) {
      std::string n = name.rfind(kPrefix, 0) == 0 ? name.substr(kPrefix.size()) : name;
      if (auto d = n.find(".default."); d != std::string::npos) n.erase(d, 8);
      if (auto d = n.find(".base_layer."); d != std::string::npos) n.erase(d, 11);
      given[n] = t;
    }
    return given;
  }

  // lora_A and lora_B of every adapted layer; the count copied.
  std::size_t load_adapter_weights(wick::Model& model, const std::map<std::string, at::Tensor>& given,
                                   const std::string& dir, const std::string& weights_file,
                                   const std::string& cfg_file) {
    std::size_t used = 0;
    for (auto& [name, lin] : adapted(model)) {
      for (auto [suffix, w] : {std::pair<std::string, at::Tensor>{".lora_A.weight", lin->lora_A->weight},
                               {".lora_B.weight", lin->lora_B->weight}}) {
        auto it = given.find(name + suffix);
        if (it == given.end()) throw wick::Error(std::string(name_) + ": " + dir + " lacks " + kPrefix + name + suffix);
        const at::Tensor& g = it->second;
        // A is [r, in], B is [out, r]: the rank the config states must be the weights'
        const bool is_a = suffix == ".lora_A.weight";
        if (g.dim() == 2 && g.size(is_a ? 0 : 1) != r_ && g.size(is_a ? 1 : 0) == w.size(is_a ? 1 : 0))
          throw wick::Error(std::string(name_) + ": " + weights_file + ": " + kPrefix + name + suffix + " has rank " +
                            std::to_string(g.size(is_a ? 0 : 1)) + " (shape " + c10::str(g.sizes()) + "), but " +
                            cfg_file + " says r " + std::to_string(r_) +
                            ", expected the adapter's weights and config to agree");
        if (g.sizes() != w.sizes())
          throw wick::Error(std::string(name_) + ": " + weights_file + ": " + kPrefix + name + suffix + " has shape " +
                            c10::str(g.sizes()) + ", the model's adapter " + c10::str(w.sizes()) +
                            ", expected an adapter made for this model");
        w.copy_(it->second);
        ++used;
      }
    }
    return used;
  }

  // The trained biases (bias = all or lora_only) and modules_to_save; the count copied.
  std::size_t load_trained_tensors(wick::Model& model, const std::map<std::string, at::Tensor>& given,
                                   const std::string& dir) {
    std::size_t used = 0;
    for (auto& [n, b] : trained_biases(model)) {
      auto it = given.find(n);
      if (it == given.end()) throw wick::Error(std::string(name_) + ": " + dir + " lacks the trained bias " + kPrefix + n);
      if (it->second.sizes() != b.sizes()) throw wick::Error(std::string(name_) + ": " + n + " has another shape in " + dir);
      b.copy_(it->second);
      ++used;
    }
    for (auto& [n, t] : saved_modules(model)) {
      auto it = given.find(n);
      if (it == given.end()) throw wick::Error(std::string(name_) + ": " + dir + " lacks " + kPrefix + n + " (modules_to_save)");
      if (it->second.sizes() != t.sizes()) throw wick::Error(std::string(name_) + ": " + n + " has another shape in " + dir);
      t.copy_(it->second);
      ++used;
    }
    return used;
  }

 public:

  void merge(wick::Model& model) override {
    for (auto& [name, lin] : adapted(model)) lin->merge_adapter();
    applied_.clear();
    for (auto& p : model.parameters()) p.set_requires_grad(true);
  }

  std::map<std::string, wick::Value> attributes() const override {
    wick::List t;
    for (const auto& s : targets_) t.push_back(wick::Value(s));
    wick::List m;
    for (const auto& s : save_modules_) m.push_back(wick::Value(s));
    std::map<std::string, wick::Value> a{{"r", r_}, {"alpha", alpha_}, {"layers", static_cast<std::int64_t>(applied_.size())},
                                         {"target_modules", t}, {"modules_to_save", m}};
    // what the quantized base weights take: 4.127 bits each with double quantization
    if (nf4_ && base_params_ > 0) {
      a["bytes_per_param"] = static_cast<double>(base_bytes_) / static_cast<double>(base_params_);
      a["base_bytes"] = base_bytes_;
      a["base_bytes_before"] = float_bytes_;
    }
    return a;
  }

 private:
  bool nf4_;
  const char* name_;  // "optim 'lora'" or "optim 'qlora'", the start of every message
  std::int64_t r_;
  double alpha_, dropout_;
  // PEFT's adapter_config form: one regular expression stays a string
  nlohmann::json peft_targets() const {
    if (targets_.size() == 1 && targets_[0].rfind("re:", 0) == 0) return targets_[0].substr(3);
    return targets_;
  }

  std::vector<std::string> targets_;
  std::vector<std::regex> patterns_;
  std::string bias_ = "none";
  std::vector<std::string> save_modules_;
  std::vector<std::string> applied_;
  at::ScalarType compute_ = at::kBFloat16;
  std::int64_t block_ = 64, base_params_ = 0, base_bytes_ = 0, float_bytes_ = 0;
  bool block_given_ = false;
};

}  // namespace

namespace wick::lora {

std::shared_ptr<wick::Transform> make_adapters(const wick::Options& options, Base base) {
  return std::make_shared<Lora>(options, base);
}

// The adapter options both plugins take.
wick::OptionSchema lora_options() {
  return {wick::opt_int("r", 8, "adapter rank").at_least(1),
          wick::opt_number("alpha", 16.0, "scale numerator: the adapter's output is multiplied by alpha / r").at_least(0),
          wick::opt_number("dropout", 0.0, "dropout on the adapter's input").range(0, 1),
          wick::opt("target_modules", wick::OptionType::StringList, wick::List{"all-linear"},
                    "module names or name suffixes (q_proj, ...), re:REGEX matching whole names, or all-linear (every "
                    "linear layer but the output head)"),
          wick::opt_string("bias", "none", "biases trained beside the adapters: none, all, or lora_only (those of adapted layers)")
              .one_of({"none", "all", "lora_only"}),
          wick::opt("modules_to_save", wick::OptionType::StringList, wick::List{},
                    "modules kept trainable beside the adapters and saved with them (PEFT's modules_to_save): a "
                    "module name, a name suffix (multi_modal_projector, lm_head) or a name prefix")};
}

wick::OptionSchema qlora_options() {
  auto o = lora_options();
  o.push_back(wick::opt_string("compute_dtype", "bf16", "dtype the 4-bit weights are dequantized to for each product")
                  .one_of({"bf16", "fp16", "fp32"}));
  o.push_back(wick::opt_int("block_size", wick::Value(),
                            "weights per NF4 block (one absmax constant each); default 64, or the block size a model "
                            "quantized on load used (its quantize_block), which a different value is refused against")
                  .at_least(2)
                  .optional());
  return o;
}

}  // namespace wick::lora
