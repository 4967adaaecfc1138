#!/usr/bin/env bash
# scripts/device-bundle's archive, unpacked into an empty folder, runs with
# nothing of this machine but glibc, libstdc++ and PyTorch's wheel: through
# bin/wick-env, with a bare environment, `wick version` names the bundle as
# its prefix, `wick plugins` loads every plugin (the media ones with the
# bundled FFmpeg), the default recipe trains; the library path holds only the
# bundle's folders and torch's; no RUNPATH or text file names a folder of this
# machine; and wick-env refuses, in one line, a Python whose torch is another
# version or that has none.
#   bundle.sh BUILD_DIR SOURCE_DIR PYTHON
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
py=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$src/scripts/device-bundle" --fast --build "$build" "$tmp/bundle.tar.xz" > "$tmp/bundle.log" 2>&1 ||
  { cat "$tmp/bundle.log"; fail "device-bundle"; }
size=$(stat -c %s "$tmp/bundle.tar.xz")
# (at xz -1; the default level, -9e, keeps it near 51 MiB, and device-bundle refuses one over 60)
[ "$size" -le $((64 * 1048576)) ] || fail "the archive is $((size / 1048576)) MiB at xz -1, over the 64 MiB a device call carries"
mkdir "$tmp/there"
tar -C "$tmp/there" -xf "$tmp/bundle.tar.xz"
B=$tmp/there/wick-bundle
[ -x "$B/bin/wick-env" ] || fail "no bin/wick-env in the archive"
torch_dir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
bare() { env -i PATH=/usr/bin:/bin HOME="$tmp" OMP_NUM_THREADS=1 WICK_PYTHON="$py" "$B/bin/wick-env" "$@"; }

# the library path: the bundle's folders, then torch's (lib/ and the nvidia/*/lib the wheel installs)
bare sh -c 'echo "$LD_LIBRARY_PATH"' | tr ':' '\n' > "$tmp/path"
while read -r d; do
  case "$d" in "$B"/*|"$torch_dir"/lib|"$(dirname "$torch_dir")"/nvidia/*) ;; *) fail "library path holds $d" ;; esac
done < "$tmp/path"

# every library wick, its libraries and plugins load resolves inside the bundle or torch's folders, or is glibc's
for f in "$B/bin/wick" "$B"/lib/*.so* "$B"/lib/wick/plugins/*.so; do
  bare ldd "$f" > "$tmp/ldd" 2>&1 || fail "ldd $f: $(cat "$tmp/ldd")"
  if grep -q "not found" "$tmp/ldd"; then fail "$f: $(grep 'not found' "$tmp/ldd" | head -3)"; fi
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    case "$path" in
      "$B"/*|"$torch_dir"/*|"$(dirname "$torch_dir")"/nvidia/*) ;;
      */libc.so.*|*/libm.so.*|*/libpthread.so.*|*/librt.so.*|*/libdl.so.*|*/libutil.so.*|*/libresolv.so.*|*/libstdc++.so.*|*/libgcc_s.so.*|*/libmvec.so.*) ;;
      *) fail "$(basename "$f") loads $name from $path, outside the bundle" ;;
    esac
  done < "$tmp/ldd"
done

# no RUNPATH and no text names this machine's folders
for f in "$B/bin/wick" "$B"/lib/*.so* "$B"/lib/wick/plugins/*.so "$B"/lib/deps/*; do
  rp=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  for e in ${rp//:/ }; do
    case "$e" in '$ORIGIN'*) ;; *) fail "$f has RUNPATH entry $e" ;; esac
  done
done
if grep -rlI -e "$src" -e "$build" -e "$HOME" "$B" > "$tmp/named" 2>/dev/null; then fail "files naming this machine's folders: $(head -3 "$tmp/named")"; fi

bare wick version > "$tmp/version"
grep -q "^prefix *$B\$" "$tmp/version" || fail "wick version: prefix is not the bundle: $(cat "$tmp/version")"
grep -q "^libtorch_dir *$torch_dir/lib\$" "$tmp/version" || fail "wick version: LibTorch not taken from torch's folder: $(cat "$tmp/version")"
bare wick plugins > "$tmp/plugins" 2>&1 || fail "wick plugins: $(cat "$tmp/plugins")"
want=$(ls "$build"/lib/wick/plugins/*.so | wc -l)
have=$(grep -cE '^(model|data|optim)' "$tmp/plugins" || true)
[ "$have" = "$want" ] || fail "wick plugins lists $have plugins, the build has $want: $(cat "$tmp/plugins")"
for p in video_folder image_folder decoder_lm vlm; do grep -q " $p " "$tmp/plugins" || fail "plugin $p not loaded"; done
(cd "$tmp" && bare wick run "$B/configs/default.lua" out="$tmp/run" epochs=1 > "$tmp/run.log" 2>&1) ||
  fail "the default recipe: $(tail -3 "$tmp/run.log")"
grep -q "^final loss" "$tmp/run.log" || fail "the default recipe printed no final loss: $(tail -3 "$tmp/run.log")"

# another torch, or none: one line, exit 2, nothing run
mkdir -p "$tmp/fake/torch"
cat > "$tmp/fake/python3" <<FAKE
#!/bin/sh
case "\$*" in *torch*) printf '%s\n%s\n%s\n' "$tmp/fake/torch" "2.10.0+cu128" "12.8" ;; esac
FAKE
chmod +x "$tmp/fake/python3"
set +e
env -i PATH=/usr/bin:/bin WICK_PYTHON="$tmp/fake/python3" "$B/bin/wick-env" touch "$tmp/ran" > "$tmp/out" 2> "$tmp/err"
rc=$?
set -e
[ "$rc" = 2 ] || fail "wick-env with torch 2.10.0+cu128 exited $rc, expected 2"
[ ! -e "$tmp/ran" ] || fail "wick-env ran the command with the wrong torch"
[ "$(wc -l < "$tmp/err")" = 1 ] || fail "wick-env's refusal is not one line: $(cat "$tmp/err")"
grep -q "2.11.0" "$tmp/err" && grep -q "2.10.0+cu128" "$tmp/err" || fail "the refusal names neither version: $(cat "$tmp/err")"
set +e
env -i PATH=/usr/bin:/bin WICK_PYTHON=/bin/false "$B/bin/wick-env" touch "$tmp/ran" 2> "$tmp/err"
rc=$?
set -e
[ "$rc" = 2 ] && [ ! -e "$tmp/ran" ] && [ "$(wc -l < "$tmp/err")" = 1 ] || fail "wick-env without torch: exit $rc, $(cat "$tmp/err")"
grep -q "cannot import torch" "$tmp/err" || fail "wick-env without torch says: $(cat "$tmp/err")"
echo "bundle: $((size / 1048576)) MiB at xz -1; version, plugins ($have), default recipe and refusals pass"
