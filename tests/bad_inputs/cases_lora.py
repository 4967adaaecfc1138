"""LoRA adapter folders (PEFT's adapter_config.json + adapter_model.safetensors)
whose config disagrees with its weights, or with the adapters already on the
model, or holds fields of the wrong type: refused, naming the file, the
tensor and both values."""
from harness import Case
from hf_files import write_adapter

MODEL = ('local wick = require "wick"\n'
         'local m = wick.model("decoder_lm", { vocab_size = 260, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2 })\n')


def adapter(recipe_tail, **kw):
    def setup(d):
        write_adapter(d / "a", **kw)
        (d / "r.lua").write_text(MODEL + recipe_tail)
    return setup


LOAD = 'wick.optim("lora", {}):load(m, "a")\n'  # the adapter's own settings
APPLIED = 'local l = wick.optim("lora", { r = 4, alpha = 8, target_modules = { "q_proj", "v_proj" } })\nl:apply(m)\nl:load(m, "a")\n'
CFG = r"optim 'lora': a/adapter_config\.json: "


def case(name, tail, message, **kw):
    return Case(name, ["run", "r.lua"], r"r\.lua:\d+: " + message, setup=adapter(tail, **kw))


CASES = [
    case("config r disagrees with the weights", LOAD,
         r"optim 'lora': a/adapter_model\.safetensors: base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight "
         r"has rank 4 \(shape \[4, 8\]\), but a/adapter_config\.json says r 8, expected the adapter's weights and config to agree",
         r=8, weights_r=4),
    case("config r disagrees with the adapters applied", APPLIED,
         CFG + r"r is 8, the adapters already on the model have r 4, expected the adapter saved with the same settings", r=8),
    case("lora_alpha disagrees with the adapters applied", APPLIED,
         CFG + r"lora_alpha is 32, the adapters already on the model have alpha 8\.0", lora_alpha=32),
    case("weights of another rank than the adapters applied", APPLIED,
         r"optim 'lora': a/adapter_model\.safetensors: .*q_proj\.lora_A\.weight has rank 2 \(shape \[2, 8\]\), but a/adapter_config\.json says r 4",
         r=4, weights_r=2),
    case("r a string", LOAD, CFG + r"r is \"8\", expected an integer of at least 1", r="8", weights_r=4),
    case("r zero", LOAD, CFG + r"r is 0, expected an integer of at least 1", r=0),
    case("r a float", LOAD, CFG + r"r is 4\.0, expected an integer of at least 1", r=4.0, weights_r=4),
    case("lora_alpha a string", LOAD, CFG + r"lora_alpha is \"16\", expected a number", lora_alpha="16"),
    case("target_modules a number", LOAD, CFG + r"target_modules is 3, expected a list", target_modules=3),
    case("target_modules naming a number", LOAD, CFG + r"target_modules is \[3\], expected a list of module names", target_modules=[3]),
    case("target_modules narrower than the weights", LOAD,
         r"optim 'lora': a holds 2 tensors for layers the model has no adapter on", target_modules=["q_proj"]),
    case("rank_pattern", LOAD, CFG + r"rank_pattern is \{\"q_proj\":2\}, expected \{\} \(a rank or alpha per module is not supported",
         rank_pattern={"q_proj": 2}),
    case("bias a number", LOAD, CFG + r"bias is 1, expected a string", bias=1),
    Case("adapter_config.json not JSON", ["run", "r.lua"], r"r\.lua:\d+: a/adapter_config\.json is not valid JSON",
         setup=lambda d: (adapter(LOAD)(d), (d / "a" / "adapter_config.json").write_text("{r: 4}"))),
    # LoraConfig fields that put adapters on other layers or change what they
    # compute: named, where they failed naming a tensor (or loaded and computed otherwise)
    case("layers_to_transform", LOAD, CFG + r"layers_to_transform is \[0\], expected null \(adapters on only some layers: "
         r"not supported\)", layers_to_transform=[0]),
    case("layers_to_transform 0", LOAD, CFG + r"layers_to_transform is 0, expected null", layers_to_transform=0),
    case("exclude_modules", LOAD, CFG + r"exclude_modules is \[\"k_proj\"\], expected null \(modules left out of "
         r"target_modules: not supported\)", exclude_modules=["k_proj"]),
    case("lora_bias", LOAD, CFG + r"lora_bias is true, expected false \(a bias on lora_B: not supported\)", lora_bias=True),
    case("fan_in_fan_out", LOAD, CFG + r"fan_in_fan_out is true, expected false \(weights stored transposed", fan_in_fan_out=True),
    case("layer_replication", LOAD, CFG + r"layer_replication is \[\[0,1\],\[0,1\]\], expected null \(replicated layers",
         layer_replication=[[0, 1], [0, 1]]),
    # PEFT writes every field: its defaults (null, false, empty) load
    Case("PEFT's defaults written out", ["run", "r.lua"], r"^loaded$", rc=0,
         setup=adapter(LOAD + 'print("loaded")\n', layers_to_transform=None, layers_pattern=None, exclude_modules=None,
                       lora_bias=False, use_qalora=False, alora_invocation_tokens=None, layer_replication=None,
                       target_parameters=None, trainable_token_indices=None, megatron_config=None, use_dora=False,
                       rank_pattern={}, alpha_pattern={}, init_lora_weights=True, loftq_config={}, eva_config=None)),
]
