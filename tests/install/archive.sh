#!/usr/bin/env bash
# The archive for other machines: cpack on the build folder writes
# wick-<version>-<system>-<arch>.tar.gz; unpacked into another folder it is a
# whole installed tree under one top folder, with no path of the build machine
# in its CMake package but the LibTorch hint, and check_prefix.sh passes on it.
#   archive.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

(cd "$tmp" && cpack -G TGZ --config "$build/CPackConfig.cmake" -B "$tmp/pkg" > "$tmp/cpack.log" 2>&1) ||
  { cat "$tmp/cpack.log"; fail "cpack"; }
archives=("$tmp"/pkg/wick-*.tar.gz)
[ ${#archives[@]} = 1 ] && [ -f "${archives[0]}" ] || fail "cpack wrote no single wick-*.tar.gz: $(ls "$tmp/pkg")"
archive=${archives[0]}
top=$(basename "$archive" .tar.gz)
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
libdir=$(cache CMAKE_INSTALL_LIBDIR) bindir=$(cache CMAKE_INSTALL_BINDIR)
version=$("$build/$bindir/wick" version | sed -n 's/^wick *//p')
[[ "$top" == "wick-$version-"* ]] || fail "archive $top does not carry wick's version $version"
tar tzf "$archive" > "$tmp/list"
# one top folder, nothing outside it
outside=$(grep -v "^$top/" "$tmp/list" || true)
[ -z "$outside" ] || fail "entries outside $top/: $outside"
for f in "$bindir/wick" "$libdir/libwick_engine.so" "$libdir/wick/plugins/decoder_lm.so" share/wick/lua/wick/init.lua \
         share/wick/presets/gpu_8gb.lua include/wick/plugin.hpp "$libdir/cmake/wick/wickConfig.cmake" \
         "$libdir/cmake/wick/wickTargets.cmake" share/doc/wick/README.md \
         share/doc/wick/docs/getting-started.md; do
  grep -qx "$top/$f" "$tmp/list" || fail "the archive lacks $f"
done
mkdir -p "$tmp/node/opt"
tar xzf "$archive" -C "$tmp/node/opt"
root=$tmp/node/opt/$top
# the CMake package names the build machine only as LibTorch's hint
leaks=$(grep -rn -e "$build" -e "$src" "$root/lib/cmake" || true)
[ -z "$leaks" ] || fail "the CMake package names the build or source folder: $leaks"
bash "$src/tests/install/check_prefix.sh" "$root" "$libdir" "$src"
# LibTorch where the user has it: LD_LIBRARY_PATH comes before the folder the
# build found (RUNPATH). A hard-linked copy of the LibTorch folder stands in
# for another node's (no gigabytes copied; skipped across file systems); a
# wheel's torch/lib finds the CUDA libraries of the nvidia wheels beside it
# through its own $ORIGIN/../../nvidia, so those are linked beside the copy.
torchlib=$("$root/$bindir/wick" version | sed -n 's/^libtorch_dir *//p')
mkdir -p "$tmp/node/site/torch"
[ -d "$torchlib/../../nvidia" ] && ln -s "$(cd "$torchlib/../../nvidia" && pwd)" "$tmp/node/site/nvidia"
other=$tmp/node/site/torch/lib
if cp -al "$torchlib" "$other" 2>/dev/null; then
  got=$(cd / && LD_LIBRARY_PATH=$other "$root/$bindir/wick" version | sed -n 's/^libtorch_dir *//p')
  [ "$got" = "$other" ] || fail "with LD_LIBRARY_PATH=$other wick loaded LibTorch from '$got'"
  out=$(cd / && LD_LIBRARY_PATH=$other "$root/$bindir/wick" plugins)
  echo "$out" | grep -Eq "^model +decoder_lm" || fail "plugins with LD_LIBRARY_PATH's LibTorch:"$'\n'"$out"
else
  echo "note: $torchlib is on another file system than $tmp; the LD_LIBRARY_PATH check is skipped"
fi
echo "PASS: $top.tar.gz unpacked elsewhere runs, trains and builds plugins"
