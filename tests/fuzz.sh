#!/usr/bin/env bash
# libFuzzer over one of wick's file readers, built with clang under
# AddressSanitizer + UndefinedBehaviorSanitizer as the media decoder's is
# (tests/plugins/lib/media/sanitize/run.sh), for FUZZ_SECONDS (default 15)
# from a seed corpus of valid files. The readers are built without LibTorch.
# Usage: fuzz.sh BUILD_DIR SOURCE_DIR TARGET, TARGET one of
#   safetensors  the safetensors header (tests/sdk/fuzz_safetensors.cpp)
#   config       a Hugging Face config.json (tests/plugins/lib/decoder/fuzz_config.cpp)
#   tokenizer    a tokenizer.json (tests/plugins/lib/tokenizer/fuzz_tokenizer.cpp)
#   jsonl        data `text`'s JSONL lines (tests/plugins/data/text/fuzz_jsonl.cpp)
#   jinja        a chat template (tests/plugins/lib/jinja/fuzz_jinja.cpp)
set -euo pipefail
BUILD=$1 SRC=$2 TARGET=$3
OUT=$BUILD/sanitize
mkdir -p "$OUT"
T=$SRC/tests
case $TARGET in
  safetensors) SOURCES=("$T/sdk/fuzz_safetensors.cpp"); LIBS=() ;;
  config) SOURCES=("$T/plugins/lib/decoder/fuzz_config.cpp" "$SRC/plugins/lib/decoder/config.cpp"); LIBS=() ;;
  tokenizer) SOURCES=("$T/plugins/lib/tokenizer/fuzz_tokenizer.cpp" "$SRC/plugins/lib/tokenizer/tokenizer.cpp")
             read -r -a LIBS <<< "$(pkg-config --cflags --libs libpcre2-8 libutf8proc)" ;;
  jsonl) SOURCES=("$T/plugins/data/text/fuzz_jsonl.cpp"); LIBS=() ;;
  jinja) SOURCES=("$T/plugins/lib/jinja/fuzz_jinja.cpp" "$SRC"/plugins/lib/jinja/*.cpp)
         read -r -a LIBS <<< "$(pkg-config --cflags --libs libutf8proc)" ;;
  *) echo "fuzz.sh: unknown target '$TARGET' (safetensors, config, tokenizer, jsonl, jinja)" >&2; exit 2 ;;
esac
BIN=$OUT/fuzz_$TARGET
# rebuilt only when a source or a header it may include changed
if [ ! -x "$BIN" ] || [ -n "$(find "${SOURCES[@]}" "$SRC/sdk/wick" "$SRC/plugins/lib/decoder" "$SRC/plugins/lib/tokenizer" \
     "$SRC/plugins/lib/jinja" \
     -newer "$BIN" -print -quit)" ]; then
  clang++ -std=c++20 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -g -O1 \
    -I"$SRC/sdk" -I"$SRC/plugins" "${SOURCES[@]}" "${LIBS[@]}" -o "$BIN"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/corpus"
# seed corpus: valid files (written by tests/bad_inputs/hf_files.py, which needs only Python's standard library)
python3 - "$SRC/tests/bad_inputs" "$WORK/corpus" "$TARGET" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
import hf_files as hf
out, target = sys.argv[2], sys.argv[3]
def put(name, data):
    open(f"{out}/{name}", "wb").write(data if isinstance(data, bytes) else data.encode())
if target == "safetensors":
    small = dict(hf.CONFIG, vocab_size=4, hidden_size=4, intermediate_size=4)
    put("decoder", hf.tensors_bytes(hf.decoder_tensors(small), {"format": "pt"}))
    put("empty", hf.safetensors_bytes({}))
    put("zero", hf.safetensors_bytes({"a": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [0, 0]},
                                      "b": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, bytes(8)))
elif target == "config":
    put("llama", json.dumps(hf.CONFIG))
    put("qwen2", json.dumps(dict(hf.CONFIG, model_type="qwen2", head_dim=4, rope_theta=None,
                                 rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=True)))
elif target == "tokenizer":
    j = hf.tokenizer_json()
    put("gpt2", json.dumps(j))
    j["normalizer"] = {"type": "NFC"}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+(?!\S)|\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    j["model"]["merges"] = [m.split(" ") for m in j["model"]["merges"]]
    put("qwen2", json.dumps(j))
elif target == "jinja":
    sys.path.insert(0, sys.argv[1] + "/../reference")
    from chat_templates import TEMPLATES
    for name, source in TEMPLATES.items():
        put(name, source)
elif target == "jsonl":
    put("lines", '{"text": "hello"}\n{"prompt": "Q:", "completion": "A"}\n{"input_ids": [1, 2, 299]}\n\n')
PY
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
"$BIN" -max_total_time="${FUZZ_SECONDS:-15}" -max_len=20000 -rss_limit_mb=2000 -timeout=10 -print_final_stats=1 \
  "$WORK/corpus" 2>&1 | tail -12
exit "${PIPESTATUS[0]}"
