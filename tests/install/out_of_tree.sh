#!/usr/bin/env bash
# Installs wick into a scratch prefix, builds examples/custom_plugin against the
# installed CMake package (find_package(wick) + wick_add_plugin), and checks that
# the installed wick lists, describes and trains with it.
#   out_of_tree.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export CCACHE_BASEDIR=$tmp CCACHE_NOHASHDIR=1
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
cp -r "$src/examples/custom_plugin" "$tmp/src"
cmake -S "$tmp/src" -B "$tmp/plugin" "${gen[@]}" "${launcher[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release -Wno-dev > "$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/plugin" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
test -f "$tmp/plugin/linear.so" || { echo "FAIL: linear.so was not built"; exit 1; }

wick=$tmp/prefix/bin/wick
export WICK_PLUGIN_PATH=$tmp/plugin
out=$("$wick" plugins)
echo "$out" | grep -Eq '^model +linear +a linear classifier' || { echo "FAIL: wick plugins:"; echo "$out"; exit 1; }
# the installed wick finds its own installed plugins too
echo "$out" | grep -q "$tmp/prefix/lib/wick/plugins" || { echo "FAIL: installed plugin folder not searched"; echo "$out"; exit 1; }
"$wick" describe linear | grep -q "classes" || { echo "FAIL: describe linear"; exit 1; }
res=$(cd / && "$wick" run "$tmp/src/recipe.lua")
echo "$res"
acc=$(echo "$res" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p')
awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' || { echo "FAIL: accuracy $acc"; exit 1; }

# The SDK headers each open with a complete plugin: the examples, taken from
# the installed headers as written, build against the package and load.
mkdir -p "$tmp/doc"
for h in plugin data optim; do
  awk '!on && /\\code$/ { on = 1; next } on && /\\endcode/ { exit } on { sub(/^\/\/\/ ?/, ""); print }' \
    "$tmp/prefix/include/wick/$h.hpp" > "$tmp/doc/doc_$h.cpp"
  grep -q WICK_PLUGIN "$tmp/doc/doc_$h.cpp" || { echo "FAIL: no complete plugin opens wick/$h.hpp"; exit 1; }
done
cat > "$tmp/doc/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(wick_doc_examples LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(wick REQUIRED)
foreach(h plugin data optim)
  wick_add_plugin(doc_${h} SOURCES doc_${h}.cpp)
endforeach()
CMAKE
cmake -S "$tmp/doc" -B "$tmp/docb" "${gen[@]}" "${launcher[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release -Wno-dev > "$tmp/doc-configure.log" 2>&1 || { cat "$tmp/doc-configure.log"; exit 1; }
cmake --build "$tmp/docb" > "$tmp/doc-build.log" 2>&1 || { cat "$tmp/doc-build.log"; exit 1; }
out=$(WICK_PLUGIN_PATH=$tmp/docb "$wick" plugins)
for want in "model +linear" "data +line" "optim/optimizer +descent"; do
  echo "$out" | grep -Eq "^$want " || { echo "FAIL: the header example '$want' is not listed:"; echo "$out"; exit 1; }
done
echo "PASS: out-of-tree plugin built against the installed package and trained; the SDK headers' examples build and load"
