#!/usr/bin/env bash
# The media decode path under AddressSanitizer + UndefinedBehaviorSanitizer,
# then libFuzzer for FUZZ_SECONDS (default 30): builds with clang into
# BUILD/sanitize (decode.cpp and make_clips.cpp need no LibTorch), drives it
# over a clip set and broken files, then fuzzes from a seed
# corpus of those clips. Usage: run.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=$1 SRC=$2
OUT=$BUILD/sanitize
mkdir -p "$OUT"
FF=$(pkg-config --cflags --libs libavformat libavcodec libswscale libavutil)
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
clang++ -std=c++20 $SAN -I"$SRC/host" -I"$SRC/plugins" "$SRC/tests/plugins/lib/media/sanitize/drive.cpp" "$SRC/plugins/lib/media/decode.cpp" \
  "$SRC/host/media/make_clips.cpp" $FF -o "$OUT/drive"
clang++ -std=c++20 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -g -O1 -I"$SRC/plugins" \
  "$SRC/tests/plugins/lib/media/sanitize/fuzz_decode.cpp" "$SRC/plugins/lib/media/decode.cpp" $FF -o "$OUT/fuzz_decode"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# broken files beside the clip set
head -c 0 /dev/null > "$WORK/empty.mp4"
head -c 40000 /dev/urandom > "$WORK/random.mp4"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
"$OUT/drive" "$WORK"
head -c 20000 "$WORK/clips/extras/bframes.mp4" > "$WORK/truncated.mp4"
head -c 30000 "$WORK/clips/extras/mpeg4.avi" > "$WORK/cut.avi"
"$OUT/drive" "$WORK"
# seed corpus: 8 request bytes + a small clip or image
mkdir -p "$WORK/corpus"
i=0
for f in "$WORK"/clips/extras/{short.mp4,vfr.mp4,mjpeg.mkv,mpeg4.avi,rotated.mp4} "$WORK"/clips/images/*/*; do
  [ -f "$f" ] || continue
  { printf '\x07\x01\x02\x20\x01\x00\x00\x03'; cat "$f"; } > "$WORK/corpus/seed$i"
  i=$((i + 1))
done
"$OUT/fuzz_decode" -max_total_time="${FUZZ_SECONDS:-30}" -max_len=200000 -rss_limit_mb=3000 -timeout=20 \
  -print_final_stats=1 "$WORK/corpus" 2>&1 | tail -15
