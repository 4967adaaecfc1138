"""Issue 16, checked again bullet by bullet: a checkpoint's state.json and a
run's run.json of the wrong types, LibTorch errors and allocation failures in
a plugin's factory, NaN in messages, JSON null, labels in JSONL token data,
image_mean/image_std, media manifests and core.json_decode."""
import json
import subprocess

from harness import Case, WICK
from hf_files import tensors_bytes

RECIPE = """local wick = require 'wick'
local a = wick.args
wick.train { model = wick.model('mlp', { inputs = 4, hidden = { 8 }, outputs = 2 }),
  data = wick.data('synthetic', { size = 16, inputs = 4, classes = 2 }),
  optim = wick.optim('sgd', { lr = 0.1 }), max_steps = tonumber(a.max_steps) or 2, micro_batch = 4, quiet = true,
  out = a.out, save_every = 1, resume = a.resume == 'true' }
"""

RESUME = ["run", "recipe.lua", "out=run", "resume=true", "max_steps=4"]
RUN = ["run/**"]


def trained(d):
    (d / "recipe.lua").write_text(RECIPE)
    subprocess.run([WICK, "run", "recipe.lua", "out=run"], cwd=d, check=True, capture_output=True)


def edit_state(edit, steps=(2,)):
    """A finished 2-step run whose state.json at each of `steps` is changed by `edit(state)`."""
    def setup(d):
        trained(d)
        for s in steps:
            p = d / "run" / "checkpoints" / f"step-{s:08d}" / "state.json"
            state = json.loads(p.read_text())
            edit(state)
            p.write_text(json.dumps(state))
    return setup


def setter(path, value):
    def edit(state):
        *parents, key = path
        node = state
        for k in parents:
            node = node[k]
        node[key] = value
    return edit


def edit_run_json(edit, folder="run"):
    def setup(d):
        trained(d)
        if folder != "run":
            (d / folder).parent.mkdir(parents=True, exist_ok=True)
            (d / "run").rename(d / folder)
        p = d / folder / "run.json"
        if callable(edit):
            meta = json.loads(p.read_text())
            edit(meta)
            p.write_text(json.dumps(meta))
        else:
            p.write_text(edit)
    return setup


def damaged(name, path, value, message):
    """The newest checkpoint's state.json with `path` set to `value`: named, and the run resumes from the older one."""
    return Case(f"state.json: {name}", RESUME, r"^wick: skipping a damaged checkpoint: run/checkpoints/step-00000002: "
                r"checkpoint run/checkpoints/step-00000002/state\.json: " + message, rc=0,
                setup=edit_state(setter(path, value)), may_write=RUN)


def recipe(text):
    def setup(d):
        (d / "r.lua").write_text("local wick = require 'wick'\n" + text)
    return setup


def jsonl(*lines):
    def setup(d):
        (d / "r.lua").write_text(
            "local wick = require 'wick'\n"
            "local data = wick.data('text', { file = 'd.jsonl', max_length = 16, cache_dir = 'none' })\n"
            "local model = wick.model('decoder_lm', { vocab_size = data.vocab_size, hidden_size = 16, layers = 1,"
            " heads = 2, intermediate_size = 32 })\n"
            "wick.train { model = model, data = data, optim = wick.optim('sgd', { lr = 0.1 }), micro_batch = 1,"
            " shuffle = false, quiet = true }\n")
        (d / "d.jsonl").write_text("".join(l + "\n" for l in lines))
    return setup


def vit_folder(preprocessor):
    """A ViT folder of no encoder layers (its embeddings and final norm) and a preprocessor_config.json."""
    def setup(d):
        m = d / "m"
        m.mkdir()
        H, P, S = 4, 2, 4
        n = (S // P) ** 2
        t = {"vit.embeddings.cls_token": ((1, 1, H), [0.0] * H),
             "vit.embeddings.position_embeddings": ((1, n + 1, H), [0.0] * ((n + 1) * H)),
             "vit.embeddings.patch_embeddings.projection.weight": ((H, 3, P, P), [0.01] * (H * 3 * P * P)),
             "vit.embeddings.patch_embeddings.projection.bias": ((H,), [0.0] * H),
             "vit.layernorm.weight": ((H,), [1.0] * H), "vit.layernorm.bias": ((H,), [0.0] * H)}
        (m / "model.safetensors").write_bytes(tensors_bytes(t, {"format": "pt"}))
        (m / "config.json").write_text(json.dumps({"model_type": "vit", "image_size": S, "patch_size": P, "hidden_size": H,
                                                   "intermediate_size": 8, "num_hidden_layers": 0,
                                                   "num_attention_heads": 2}))
        (m / "preprocessor_config.json").write_text(json.dumps(preprocessor))
        (d / "r.lua").write_text("local wick = require 'wick'\nwick.model('vit', { path = 'm' })\n")
    return setup


def manifest(*lines):
    def setup(d):
        (d / "m.jsonl").write_text("".join(l + "\n" for l in lines))
        (d / "r.lua").write_text("local wick = require 'wick'\nwick.data('image_folder', { manifest = 'm.jsonl' })\n")
    return setup


CASES = [
    # a checkpoint's state.json: every field a resume reads is checked; a damaged newest one is named and skipped
    damaged("epoch a string", ("extra", "epoch"), "0", r'extra\.epoch is "0", expected an integer'),
    damaged("window null", ("extra", "window"), None, r"extra\.window is null, expected a value"),
    damaged("extra a string", ("extra",), "x", r'extra is "x", expected an object'),
    damaged("world_size 1.5", ("extra", "world_size"), 1.5, r"extra\.world_size is 1\.5, expected an integer"),
    damaged("skipped_steps a string", ("skipped_steps",), "0", r'skipped_steps is "0", expected an integer'),
    damaged("files a string", ("files",), "x", r'files is "x", expected an object'),
    damaged("a file's bytes a string", ("files", "model.safetensors", "bytes"), "528",
            r'files\.model\.safetensors\.bytes is "528", expected an integer'),
    damaged("a file's entry a string", ("files", "rng.safetensors"), "x",
            r'files\.rng\.safetensors is "x", expected an object'),
    damaged("a crc32c a number", ("files", "model.safetensors", "crc32c"), 5,
            r"files\.model\.safetensors\.crc32c is 5, expected a string"),
    damaged("step negative", ("step",), -5, r"step is -5, expected an integer of at least 0"),
    damaged("loss_scale a number", ("loss_scale",), 3, r"loss_scale is 3, expected an object"),
    # the monitored metric's record (best checkpoints, patience's count)
    damaged("monitor a string", ("extra", "monitor"), "eval_loss", r'extra\.monitor is "eval_loss", expected an object'),
    damaged("monitor mode up", ("extra", "monitor"), {"name": "eval_loss", "mode": "up"},
            r'extra\.monitor\.mode is "up", expected "min" or "max"'),
    damaged("monitor bad_evals negative", ("extra", "monitor"), {"name": "eval_loss", "mode": "min", "bad_evals": -1},
            r"extra\.monitor\.bad_evals is -1, expected an integer"),
    damaged("monitor value a string", ("extra", "monitor"), {"name": "eval_loss", "mode": "min", "value": "low"},
            r'extra\.monitor\.value is "low", expected a number'),
    Case("state.json: every checkpoint damaged", RESUME,
         r"wick\.train: resume = true, but no checkpoint in run/checkpoints is intact: .*state\.json: "
         r'skipped_steps is "0", expected an integer', setup=edit_state(setter(("skipped_steps",), "0"), steps=(1, 2))),

    # run.json of the wrong types: a resume refuses it by name; runs and report warn and show the rest
    Case("run.json: resume with a status of 3", RESUME,
         r"resume = true, but run/run\.json: status is 3, expected a string \(mend it, or remove it",
         setup=edit_run_json(setter(("status",), 3))),
    Case("run.json: resume a finished run whose final_loss is a string", RESUME,
         r'resume = true, but run/run\.json: final_loss is "x", expected a number',
         setup=edit_run_json(setter(("final_loss",), "x"))),
    Case("run.json: resume with total_steps a string", RESUME,
         r'run/run\.json: total_steps is "2", expected an integer', setup=edit_run_json(setter(("total_steps",), "2"))),
    Case("run.json: resume when it is not JSON", RESUME, r"resume = true, but run/run\.json is not valid JSON: ",
         setup=edit_run_json("{not json")),
    Case("runs: a status of 3", ["runs"],
         r"^wick: warning: runs/r/run\.json: 'status' is a number, expected a string; shown without it$", rc=0,
         setup=edit_run_json(setter(("status",), 3), folder="runs/r")),
    Case("runs: run.json not JSON", ["runs"], r"^wick: warning: runs/r/run\.json is not valid JSON: .*; shown without it",
         rc=0, setup=edit_run_json("[1,", folder="runs/r")),
    Case("report: options a number", ["report", "runs/r"],
         r"^wick: warning: runs/r/run\.json: 'options' is a number, expected an object; the report leaves it out$", rc=0,
         setup=edit_run_json(setter(("options",), 5), folder="runs/r"), may_write=["runs/r/report.html"]),
    Case("report: seconds a string", ["report", "runs/r"], r"runs/r/run\.json: 'seconds' is a string, expected a number",
         rc=0, setup=edit_run_json(setter(("seconds",), "x"), folder="runs/r"), may_write=["runs/r/report.html"]),

    # LibTorch's errors and failed allocations in a plugin's factory: one line, the options named
    Case("mlp hidden 2^40", ["run", "r.lua"],
         r"model 'mlp' \(.*\) failed to build: its tensors at these sizes need more memory than can be allocated "
         r"\(17592186044416 bytes\); the largest sizes among its options: hidden = \{1099511627776\}",
         setup=recipe("wick.model('mlp', { inputs = 4, hidden = { 2^40 }, outputs = 2 })\n")),
    Case("mlp sizes whose product overflows", ["run", "r.lua"],
         r"model 'mlp' \(.*\) failed to build: its tensors at these sizes need more memory than can be allocated; "
         r"the largest sizes among its options: (hidden = \{2147483648\}, inputs = 2147483648|inputs = 2147483648, "
         r"hidden = \{2147483648\})$",
         setup=recipe("wick.model('mlp', { inputs = 2^31, hidden = { 2^31 }, outputs = 2 })\n")),
    Case("vit image_size 2^20", ["run", "r.lua"],
         r"model 'vit' \(.*\) failed to build: its tensors .* the largest sizes among its options: image_size = 1048576",
         setup=recipe("wick.model('vit', { image_size = 2^20, patch_size = 1, hidden_size = 8, heads = 2 })\n")),

    # NaN reads "nan" (0/0 in Lua is -nan)
    Case("lr = 0/0 in a recipe", ["run", "r.lua"], r"optim 'sgd': option 'lr': expected a finite number, got number nan$",
         setup=recipe("wick.optim('sgd', { lr = 0/0 })\n")),

    # labels in JSONL token data: read beside input_ids, refused anywhere else
    Case("labels beside input_ids are honoured", ["run", "r.lua"],
         r"^wick: data 'text': skipping d\.jsonl:1: every label after the first token is masked", rc=0,
         setup=jsonl('{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}', '{"input_ids": [4, 5, 6]}')),
    Case("labels beside text", ["run", "r.lua"], r"d\.jsonl:1: labels without input_ids: labels are read only beside input_ids",
         setup=jsonl('{"text": "abc", "labels": [1, 2, 3]}')),
    Case("labels of another length", ["run", "r.lua"],
         r"d\.jsonl:1: labels holds 2 values, expected one per input_ids \(3\)",
         setup=jsonl('{"input_ids": [1, 2, 3], "labels": [1, 2]}')),
    Case("a label 1.5", ["run", "r.lua"], r"d\.jsonl:2: labels\[1\] is 1\.5, expected -100 or an integer in \[0, 257\)",
         setup=jsonl('{"input_ids": [1, 2]}', '{"input_ids": [1, 2], "labels": [1, 1.5]}')),
    Case("an input id 2.0", ["run", "r.lua"], r"d\.jsonl:1: input_ids\[0\] is 2\.0, expected an integer in \[0, 257\)",
         setup=jsonl('{"input_ids": [2.0, 3]}')),

    # JSON null is said as null, not as missing
    Case("config.json hidden_size null", ["run", "r.lua"], r"m/config\.json: hidden_size is null, expected an integer",
         setup=lambda d: (__import__("hf_files").write_decoder(d / "m", hidden_size=None),
                          (d / "r.lua").write_text("local wick = require 'wick'\nwick.model('decoder_lm', { path = 'm' })\n"))),

    # image_mean / image_std in preprocessor_config.json
    Case("image_mean a string", ["run", "r.lua"],
         r'm/preprocessor_config\.json: image_mean is "0\.5", expected a list of 3 numbers',
         setup=vit_folder({"image_mean": "0.5", "image_std": [0.5, 0.5, 0.5]})),
    Case("image_std of two numbers", ["run", "r.lua"],
         r"m/preprocessor_config\.json: image_std is \[0\.5,0\.5\], expected a list of 3 numbers above 0",
         setup=vit_folder({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5]})),
    Case("image_std with a zero", ["run", "r.lua"], r"image_std is \[0\.5,0,0\.5\], expected a list of 3 numbers above 0",
         setup=vit_folder({"image_std": [0.5, 0, 0.5]})),

    # a media manifest's JSONL lines
    Case("manifest line not JSON", ["run", "r.lua"], r"m\.jsonl:2: not JSON \(parse error at line 1, column 10: syntax error",
         setup=manifest('{"path": "a.png"}', '{"path": ')),
    Case("manifest label 1.5", ["run", "r.lua"],
         r"m\.jsonl:1: label is 1\.5, expected a class index \(an integer >= 0\) or a class name",
         setup=manifest('{"path": "a.png", "label": 1.5}')),
    Case("manifest text a number", ["run", "r.lua"], r"m\.jsonl:1: text is 3, expected a string",
         setup=manifest('{"path": "a.png", "text": 3}')),

    # core.json_decode: what is wrong, without nlohmann's tag; the source named when given
    Case("json_decode names its source", ["run", "r.lua"], r"r\.lua:2: x\.json is not valid JSON: .*syntax error",
         setup=recipe("wick.core.json_decode('{bad', 'x.json')\n")),
    Case("json_decode without a source", ["run", "r.lua"], r"r\.lua:2: invalid JSON: number overflow parsing '1e999'",
         setup=recipe("wick.core.json_decode('[1e999]')\n")),
]
