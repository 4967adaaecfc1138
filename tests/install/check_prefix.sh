#!/usr/bin/env bash
# Checks an installed wick tree wherever it lies (installed, moved, unpacked):
# it finds its own plugins, Lua package and presets from where it is; a recipe
# trains from another working folder; a plugin project builds against its CMake
# package and installs both to its own prefix (named on WICK_PLUGIN_PATH) and
# next to wick's plugins.
#   check_prefix.sh PREFIX LIBDIR SOURCE_DIR
# LIBDIR: the tree's library folder relative to PREFIX (lib, lib64, lib/x86_64-linux-gnu).
# Nothing of the build tree may be used: WICK_* variables are cleared.
set -euo pipefail
prefix=$(cd "$1" && pwd -P)
libdir=$2
src=$(cd "$3" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in $(compgen -e | grep '^WICK_' || true); do unset "$v"; done
export CCACHE_BASEDIR=$tmp CCACHE_NOHASHDIR=1
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
fail() { echo "FAIL ($prefix): $*"; exit 1; }
wick=$prefix/bin/wick
plugins=$prefix/$libdir/wick/plugins
# find_package(wick) through CMAKE_PREFIX_PATH, as users do; CMake searches
# <prefix>/lib64 only where the platform uses it (not Debian), so there wick_DIR
find=(-DCMAKE_PREFIX_PATH="$prefix")
[ "$libdir" = lib64 ] && find+=(-Dwick_DIR="$prefix/$libdir/cmake/wick")

test -d "$plugins" || fail "no plugin folder $plugins"
test -f "$prefix/$libdir/cmake/wick/wickConfig.cmake" || fail "no CMake package in $prefix/$libdir/cmake/wick"
# the manual: README, every page of docs/ and mkdocs.yml, which lists them
doc=$prefix/share/doc/wick
for f in README.md mkdocs.yml docs/index.md docs/getting-started.md docs/reference/train.md; do
  test -f "$doc/$f" || fail "no $f in $doc (cmake --install puts the manual there)"
done
for page in $(cd "$src" && find docs -name '*.md'); do
  cmp -s "$src/$page" "$doc/$page" || fail "$doc/$page differs from the source's $page, or is missing"
done

# wick version names the folders this tree uses, found from where it is
ver=$(cd / && "$wick" version)
field() { echo "$ver" | sed -n "s/^$1 *//p"; }
[ "$(field prefix)" = "$prefix" ] || fail "wick version says prefix $(field prefix):"$'\n'"$ver"
[ "$(field plugins)" = "$plugins" ] || fail "wick version says plugins $(field plugins):"$'\n'"$ver"
[ "$(field lua)" = "$prefix/share/wick/lua" ] || fail "wick version says lua $(field lua):"$'\n'"$ver"

out=$(cd / && "$wick" plugins)
for want in "model +decoder_lm" "model +mlp" "data +synthetic" "optim/optimizer +adamw "; do
  echo "$out" | grep -Eq "^$want" || fail "wick plugins lists no '$want':"$'\n'"$out"
done
echo "$out" | grep -q "$plugins" || fail "wick plugins does not name $plugins:"$'\n'"$out"

# a recipe with built-in plugins and a preset (the tree's share/wick/presets), run from /
cat > "$tmp/recipe.lua" <<'LUA'
local wick = require "wick"
local data = wick.data("synthetic", { size = 256, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = data.inputs, outputs = data.num_classes, hidden = { 16 } })
local run = wick.train(wick.preset("max_speed", {
  model = model, data = data, optim = wick.optim("adamw", { lr = 0.02 }), precision = "fp32",
  micro_batch = 16, epochs = 4, eval_data = data, workers = 0, quiet = true,
}))
print(string.format("mlp: %d steps, accuracy %.3f", run.steps, run.eval.accuracy))
LUA
res=$(cd / && "$wick" run "$tmp/recipe.lua" out="$tmp/run" 2>"$tmp/err") || fail "the recipe failed: $(cat "$tmp/err")"
acc=$(echo "$res" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p')
awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' || fail "recipe accuracy '$acc': $res"

# a plugin project against this tree's CMake package: INSTALL to its own prefix ...
cp -r "$src/examples/custom_plugin" "$tmp/src"
cmake -S "$tmp/src" -B "$tmp/plugin" "${gen[@]}" "${launcher[@]}" "${find[@]}" \
  -DCMAKE_BUILD_TYPE=Release -Wno-dev > "$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "configure"; }
grep -q "$prefix/$libdir/cmake/wick" "$tmp/plugin/CMakeCache.txt" || fail "the plugin project did not find wick in $prefix"
cmake --build "$tmp/plugin" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "build"; }
cmake --install "$tmp/plugin" --prefix "$tmp/mine" > "$tmp/install.log" || fail "plugin install"
own=$(dirname "$(find "$tmp/mine" -name linear.so)")
[[ "$own" == "$tmp/mine/"*"/wick/plugins" ]] || fail "INSTALL put linear.so in '$own', expected <prefix>/<libdir>/wick/plugins"
out=$(WICK_PLUGIN_PATH=$own "$wick" plugins)
echo "$out" | grep -Eq '^model +linear +a linear classifier' || fail "linear not listed from $own:"$'\n'"$out"
res=$(cd / && WICK_PLUGIN_PATH=$own "$wick" run "$tmp/src/recipe.lua" 2>"$tmp/err") || fail "the linear recipe failed: $(cat "$tmp/err")"
acc=$(echo "$res" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p')
awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' || fail "linear accuracy '$acc': $res"

# ... and INSTALL DESTINATION ${wick_PLUGIN_DIR}: next to wick's own plugins,
# found with no WICK_PLUGIN_PATH. The SDK headers' opening examples, taken
# from the installed headers as written, are the plugins.
mkdir -p "$tmp/doc"
for h in plugin data optim; do
  awk '!on && /\\code$/ { on = 1; next } on && /\\endcode/ { exit } on { sub(/^\/\/\/ ?/, ""); print }' \
    "$prefix/include/wick/$h.hpp" > "$tmp/doc/doc_$h.cpp"
  grep -q WICK_PLUGIN "$tmp/doc/doc_$h.cpp" || fail "no complete plugin opens wick/$h.hpp"
done
cat > "$tmp/doc/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(wick_doc_examples LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(wick REQUIRED)
foreach(h plugin data optim)
  wick_add_plugin(doc_${h} SOURCES doc_${h}.cpp INSTALL DESTINATION "${wick_PLUGIN_DIR}")
endforeach()
CMAKE
cmake -S "$tmp/doc" -B "$tmp/docb" "${gen[@]}" "${launcher[@]}" "${find[@]}" \
  -DCMAKE_BUILD_TYPE=Release -Wno-dev > "$tmp/doc-configure.log" 2>&1 || { cat "$tmp/doc-configure.log"; fail "configure (doc)"; }
cmake --build "$tmp/docb" > "$tmp/doc-build.log" 2>&1 || { cat "$tmp/doc-build.log"; fail "build (doc)"; }
cmake --install "$tmp/docb" > "$tmp/doc-install.log" || fail "install (doc)"
out=$(cd / && "$wick" plugins)
for want in "model +linear" "data +line" "optim/optimizer +descent"; do
  echo "$out" | grep -Eq "^$want " || fail "the header example '$want' is not listed next to wick's plugins:"$'\n'"$out"
done
rm -f "$plugins"/doc_*.so
echo "PASS ($prefix): carries its manual, finds its plugins and Lua package, trains a recipe, builds and installs plugins both ways"
