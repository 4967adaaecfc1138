#pragma once
/// \file plugin.hpp
/// The wick plugin SDK. A complete plugin is one .cpp file:
///
/// \code
///   #include <wick/plugin.hpp>
///   #include <wick/model.hpp>
///   #include <torch/nn/modules/linear.h>
///
///   // A linear classifier: forward returns the summed loss and the item count.
///   class Linear : public wick::Model {
///    public:
///     explicit Linear(const wick::Options& o)
///         : fc_(register_module("fc", torch::nn::Linear(o.get_int("inputs"), o.get_int("classes")))) {}
///     wick::ForwardResult forward(const wick::Batch& b) override {
///       auto logits = fc_->forward(b.at("x"));
///       auto y = b.at("y");
///       return {at::cross_entropy_loss(logits, y, {}, at::Reduction::Sum), y.size(0),
///               {{"accuracy", logits.argmax(1).eq(y).sum()}}};
///     }
///    private:
///     torch::nn::Linear fc_;
///   };
///
///   WICK_PLUGIN(wick::plugin<Linear>(                                     // the kind: Linear's base
///       "linear", "a linear classifier",
///       {wick::opt_int("inputs", 4, "input features").at_least(1),       // Required entries:
///        wick::opt_int("classes", 2, "output classes").at_least(1)}))    // name, summary, options
/// \endcode
///
/// Build it with the installed CMake package:
/// \code
///   find_package(wick REQUIRED)
///   wick_add_plugin(linear SOURCES linear.cpp)
/// \endcode
/// and put the .so on WICK_PLUGIN_PATH; `wick plugins` lists it and
/// `wick describe linear` shows its options.
///
/// Kinds and their base classes: model -> wick::Model (wick/model.hpp; with
/// the optional capabilities Predictor, Generator, WindowCoupled, HostLookups
/// (offload_embeddings) and Deferred (weights read from a file when used)
/// there and AdapterTargets in wick/kit/linear.hpp), data -> wick::Dataset
/// (wick/data.hpp), optim -> wick::Optimizer, wick::Schedule, wick::Transform
/// (wick/optim.hpp). Each of those headers opens with a complete plugin of
/// its kind. wick/kit/ holds optional helpers (safetensors files, Hugging
/// Face weights, linear layers with LoRA and NF4) that plugins may use.
///
/// A factory that picks one of several classes from its options (as lora and
/// qlora, or video_folder and image_folder, share one implementation) names
/// their common base and passes the factory:
/// \code
///   WICK_PLUGIN(wick::plugin<wick::Transform>("lora", "LoRA adapters", options, &make_adapters))
/// \endcode
///
/// ABI versions (WICK_ABI_VERSION): 10 let wick::Linear quantize a deferred
/// layer (quantize_nf4 on a hollow weight: a hollow NF4 layer whose float
/// weight, made later under its former tensor, the host quantizes as it
/// arrives), which adds a member to LinearImpl. 9 made a deferred build's sink a
/// wick::Emit (Deferred::materialize(const Emit&)), which can take a 4-bit
/// weight from the float weight it is quantized from (Emit::nf4), so a rank
/// of a divided run quantizes only its part; the names ABI 8 replaced went.
/// 8 gave OptionSpec min_open and max_open
/// (ranges open at an end, OptionBuilder's above and below, which the host's
/// own schema uses too) and named the option type of Lua's numbers one way,
/// "number": OptionType::Number and NumberList, opt_number,
/// Options::get_number and get_number_list, Value::as_number. The names they
/// replace (Float, FloatList, opt_float, get_double, get_double_list,
/// as_double) still compile through ABI 8, marked deprecated, and go with 9.
/// 7 gave GenerateOptions eos_ids,
/// repetition_penalty and stop, gave Dataset's encode and decode
/// transformers' add_special_tokens and skip_special_tokens, and added
/// Dataset::apply_chat_template. 6 added the descriptor's `makes` (the
/// object kind the factory builds: optimizer, schedule or transform for an
/// optim plugin), checked against what the factory returns; make_descriptor
/// left the public API (wick::plugin<T> is the one builder); GenerateOptions
/// gained on_token (tokens streamed as they are chosen). 5 made Model a small core (forward,
/// count_items, item_name, blocks, run_block) with capabilities found by
/// capability<C>(); targets() went; block checkpointing state left Model
/// for a host-side BlockRunner; one builder, wick::plugin<T>, takes the kind
/// from T's base. 4 added window-coupled losses, 3 Dataset::set_epoch.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <torch/version.h>

#include <boost/dll/alias.hpp>

#include "wick/object.hpp"
#include "wick/options.hpp"
#include "wick/version.hpp"  // WICK_VERSION_STRING, made by CMake from the project's version

/// The plugin ABI. Bumped whenever any type that crosses the plugin boundary changes.
#define WICK_ABI_VERSION 10

namespace wick {

constexpr std::uint32_t kAbiVersion = WICK_ABI_VERSION;

enum class PluginKind { Model, Data, Optim };

inline const char* to_string(PluginKind k) {
  switch (k) {
    case PluginKind::Model: return "model";
    case PluginKind::Data: return "data";
    case PluginKind::Optim: return "optim";
  }
  return "?";
}

using Factory = std::shared_ptr<Object> (*)(const Options&);

/// What a plugin library exports under the alias `wick_plugin`.
/// The first three fields are frozen for all ABI versions: the host reads
/// them, checks the versions, and only then looks at anything else.
struct PluginDescriptor {
  std::uint32_t abi_version;   ///< Required: kAbiVersion (WICK_PLUGIN sets it)
  const char* torch_version;   ///< Required: the LibTorch version built against
  const char* name;            ///< Required: unique plugin name
  // ---- read only after the versions match ----
  PluginKind kind;             ///< Required: the recipe function that builds it (wick.model/data/optim)
  ObjectKind makes;            ///< Required: what the factory returns (an optim plugin: optimizer, schedule or transform)
  const char* summary;         ///< Required: one line
  OptionSchema options;        ///< Optional: declared options
  Factory create;              ///< Required: builds the object from validated options
};

namespace detail {
template <class T, class Base>
std::shared_ptr<Object> make_object(const Options& o) {
  static_assert(std::is_base_of_v<Base, T>, "plugin class has the wrong base for its kind");
  return std::make_shared<T>(o);
}
}  // namespace detail

/// The plugin kind of each object kind: optimizers, schedules and transforms
/// are all built by wick.optim.
constexpr PluginKind plugin_kind_of(ObjectKind k) {
  return k == ObjectKind::Model ? PluginKind::Model : k == ObjectKind::Dataset ? PluginKind::Data : PluginKind::Optim;
}

/// The descriptor of plugin class T, its kind taken from T's base (Model,
/// Dataset, Optimizer, Schedule or Transform); T is built from wick::Options.
template <class T>
PluginDescriptor plugin(const char* name, const char* summary, OptionSchema options = {}) {
  static_assert(std::is_base_of_v<Object, T>, "a plugin class derives from wick::Model, wick::Dataset, "
                                              "wick::Optimizer, wick::Schedule or wick::Transform");
  return PluginDescriptor{kAbiVersion, TORCH_VERSION, name, plugin_kind_of(T::object_type), T::object_type,
                          summary, std::move(options), &detail::make_object<T, Object>};
}

/// The same, with a factory of its own: Base is the base class of what it
/// returns (the host checks), for a plugin that picks its class from options.
template <class Base>
PluginDescriptor plugin(const char* name, const char* summary, OptionSchema options, Factory create) {
  static_assert(std::is_base_of_v<Object, Base>, "Base is wick::Model, wick::Dataset, wick::Optimizer, "
                                                 "wick::Schedule or wick::Transform");
  return PluginDescriptor{kAbiVersion, TORCH_VERSION, name, plugin_kind_of(Base::object_type), Base::object_type,
                          summary, std::move(options), create};
}

}  // namespace wick

/// Exports the plugin's descriptor. Write it once, at namespace scope.
#define WICK_PLUGIN(...)                                                  \
  namespace wick_plugin_detail {                                          \
  const ::wick::PluginDescriptor wick_plugin_descriptor = (__VA_ARGS__); \
  }                                                                       \
  BOOST_DLL_ALIAS(wick_plugin_detail::wick_plugin_descriptor, wick_plugin)

