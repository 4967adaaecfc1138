"""safetensors files: what the reference library refuses (gaps, overlaps,
duplicate names, fractional or negative sizes, overflowing shapes, sizes that
disagree with the offsets, wrong-typed header fields, a folder for a file) is
refused with the file and the tensor or key named. Read through `wick
generate` of a model folder and through a recipe's load."""
import json
import struct

from harness import Case
from hf_files import decoder_tensors, safetensors_bytes, tensors_bytes, write_decoder

F = "model.safetensors"


def folder(header, data=b""):
    """A decoder folder whose model.safetensors has this header and data."""
    def setup(d):
        write_decoder(d / "m", weights=safetensors_bytes(header, data))
    return setup


def t(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def gen(name, setup, message):
    return Case(name, ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"], r"corrupt safetensors file m/model\.safetensors: " + message,
                setup=setup)


def valid_weights_with(edit):
    """The decoder's valid file with its JSON header edited by `edit(header)`."""
    def setup(d):
        raw = tensors_bytes(decoder_tensors())
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        data = raw[8 + n:]
        out = edit(header, data)
        header, data = out if isinstance(out, tuple) else (out, data)
        write_decoder(d / "m", weights=safetensors_bytes(header, data))
    return setup


def overlap(h, data):
    h["lm_head.weight"]["data_offsets"] = h["model.embed_tokens.weight"]["data_offsets"]
    return h, data[: -260 * 8 * 4]


RECIPE = 'local wick = require "wick"\nwick.model("mlp", { inputs = 2, hidden = { 2 }, outputs = 1 }):load("w.safetensors")\n'


def recipe_load(raw=None, folder_instead=False):
    def setup(d):
        (d / "r.lua").write_text(RECIPE)
        if folder_instead:
            (d / "w.safetensors").mkdir()
        else:
            (d / "w.safetensors").write_bytes(raw)
    return setup


CASES = [
    gen("overlapping offsets", valid_weights_with(overlap), r"tensor '(lm_head|model\.embed_tokens)\.weight': data_offsets begin at byte 0, "
        r"expected \d+ where '.*' ends \(tensors lie back to back"),
    gen("gap before the first tensor", folder({"a": t("F32", [1], [4, 8])}, bytes(8)),
        r"tensor 'a': data_offsets begin at byte 4, expected 0"),
    gen("offsets outside the file", folder({"a": t("F32", [4], [0, 16])}, bytes(8)),
        r"tensor 'a' ends at data byte 16, outside the file's 8 data bytes"),
    gen("bytes after the last tensor", folder({"a": t("F32", [1], [0, 4])}, bytes(8)),
        r"the tensors cover 4 of the file's 8 data bytes, expected the data to end where the last tensor ends"),
    gen("duplicate tensor names", folder(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                         b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        r"tensor 'a' is named twice in the header, expected unique names"),
    gen("fractional size", folder(b'{"a":{"dtype":"F32","shape":[16.5,8],"data_offsets":[0,8]}}', bytes(8)),
        r"tensor 'a': shape\[0\] is 16\.5, expected a non-negative integer"),
    gen("size written as a float", folder(b'{"a":{"dtype":"F32","shape":[2,2.0],"data_offsets":[0,16]}}', bytes(16)),
        r"tensor 'a': shape\[1\] is 2\.0, expected a non-negative integer"),
    gen("negative size", folder(b'{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8)),
        r"tensor 'a': shape\[0\] is -2, expected a non-negative integer"),
    gen("shape product overflows", folder({"a": t("F32", [2 ** 62, 2 ** 62, 2 ** 62], [0, 8])}, bytes(8)),
        r"tensor 'a': shape \[.* of F32 holds more bytes than 64 bits can count"),
    gen("2^40 x 2^40 shape", folder({"a": t("F32", [2 ** 40, 2 ** 40], [0, 0])}),
        r"tensor 'a': shape \[1099511627776,1099511627776\] of F32 holds more bytes than 64 bits can count"),
    gen("zero times 2^40 x 2^40", folder({"a": t("F32", [0, 2 ** 40, 2 ** 40], [0, 0])}),
        r"tensor 'a': shape .* holds more bytes than 64 bits can count"),
    gen("size disagrees with the offsets", folder({"a": t("F32", [3], [0, 8])}, bytes(8)),
        r"tensor 'a' has 8 bytes \(data_offsets \[0,8\]\), its shape \[3\] and dtype F32 need 12"),
    gen("dtype is a number", folder(b'{"a":{"dtype":3,"shape":[2],"data_offsets":[0,8]}}', bytes(8)),
        r"tensor 'a': dtype is 3, expected a string"),
    gen("unknown dtype", folder({"a": t("F33", [2], [0, 8])}, bytes(8)), r"tensor 'a' has unsupported dtype F33, expected F64"),
    gen("shape is a string", folder(b'{"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}', bytes(8)),
        r"tensor 'a': shape is \"2\", expected a list of integers"),
    gen("offsets are strings", folder(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}', bytes(8)),
        r"tensor 'a': data_offsets is \[\"0\",\"8\"\], expected two non-negative integers"),
    gen("offsets reversed", folder({"a": t("F32", [0], [8, 0])}, bytes(8)),
        r"tensor 'a': data_offsets \[8,0\] end before they begin"),
    gen("tensor lacks its shape", folder(b'{"a":{"dtype":"F32","data_offsets":[0,8]}}', bytes(8)),
        r"tensor 'a' lacks shape, expected dtype, shape and data_offsets"),
    gen("tensor entry is a list", folder(b'{"a":[1,2]}'), r"tensor 'a' is \[1,2\], expected an object"),
    gen("metadata value is a number", folder(b'{"__metadata__":{"format":1}}'),
        r"__metadata__ key 'format' is 1, expected a string"),
    gen("header is a list", folder(b"[]"), r"header is a JSON array, expected an object of tensors"),
    gen("NUL padding after the header", folder(b'{}\0\0\0\0\0\0'), r"header holds a NUL byte at offset 2"),
    gen("invalid UTF-8 in the header", folder(b'{"\xff":1}'), r"header is not valid JSON \(.*ill-formed UTF-8"),
    gen("header length beyond the file", lambda d: write_decoder(d / "m", weights=b"\xe8\x03" + bytes(6) + b"{}"),
        r"header length 1000 exceeds the file size 10"),
    gen("file shorter than 8 bytes", lambda d: write_decoder(d / "m", weights=b"\x02\0"),
        r"shorter than its 8-byte header length"),
    Case("folder given as the weights file", ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"],
         r"safetensors file m/model\.safetensors is a directory, expected a \.safetensors file",
         setup=lambda d: (write_decoder(d / "m"), (d / "m" / F).unlink(), (d / "m" / F).mkdir())),
    Case("recipe loads a folder as a safetensors file", ["run", "r.lua"],
         r"r\.lua:2: .*safetensors file w\.safetensors is a directory, expected a \.safetensors file",
         setup=recipe_load(folder_instead=True)),
    Case("recipe saves onto a folder", ["run", "s.lua"],
         r"s\.lua:2: cannot write w\.safetensors: it is a folder, expected a file path",
         setup=lambda d: ((d / "s.lua").write_text(RECIPE.replace(':load("w.safetensors")', ':save("w.safetensors")')),
                          (d / "w.safetensors").mkdir())),
    Case("recipe loads overlapping tensors", ["run", "r.lua"],
         r"r\.lua:2: .*corrupt safetensors file w\.safetensors: tensor '0\.weight': data_offsets begin at byte 0, expected 8",
         setup=recipe_load(safetensors_bytes({"0.weight": t("F32", [2], [0, 8]), "0.bias": t("F32", [2], [0, 8])},
                                             bytes(8)))),
    # another kind of file under the name: said to be no safetensors file, its
    # first 8 bytes not echoed as a header length, a link's target named
    Case("model.safetensors a link to a text file", ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"],
         r"^wick: .*m/model\.safetensors \(a link to /.*/notes\.txt\) is not a safetensors file: it does not start with "
         r"the 8-byte length of a JSON header that fits in its 26 bytes, expected a safetensors file",
         setup=lambda d: (write_decoder(d / "m"), (d / "notes.txt").write_text("these are not the weights\n"),
                          (d / "m" / F).unlink(), (d / "m" / F).symlink_to(d / "notes.txt"))),
    Case("model.safetensors a text file", ["generate", "m", "tokenizer=bytes", "max_new_tokens=2"],
         r"^wick: .*m/model\.safetensors is not a safetensors file: it does not start with the 8-byte length",
         setup=lambda d: write_decoder(d / "m", weights=b"version https://git-lfs.github.com/spec/v1\n")),
]

