#!/usr/bin/env bash
# Installs wick into a scratch prefix (as configured: lib) and checks it with
# check_prefix.sh: the installed wick finds its plugins and Lua package, trains
# a recipe, and the installed CMake package builds examples/custom_plugin and
# the SDK headers' examples, installed to their own prefix and next to wick's
# plugins. Then wick_add_plugin's bad arguments are refused by name.
#   out_of_tree.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:[A-Z]*=//p' "$build/CMakeCache.txt")
bash "$src/tests/install/check_prefix.sh" "$tmp/prefix" "$libdir" "$src"

# wick_add_plugin's arguments: each mistake is named before anything is made
# (script mode: the checks come before add_library)
bad() {  # bad 'ARGS' 'expected words'
  printf 'include("%s")\nwick_add_plugin(%s)\n' "$tmp/prefix/$libdir/cmake/wick/wickPlugin.cmake" "$1" > "$tmp/bad.cmake"
  if cmake -P "$tmp/bad.cmake" > "$tmp/bad.log" 2>&1; then fail "wick_add_plugin($1) was accepted"; fi
  grep -qF "$2" "$tmp/bad.log" || { cat "$tmp/bad.log"; fail "wick_add_plugin($1): the error does not say '$2'"; }
}
bad 'p' "wick_add_plugin(p): SOURCES is required"
bad 'p linear.cpp SOURCES a.cpp' "unknown argument(s) 'linear.cpp'"
bad 'p SOURCES a.cpp OUTPUT_DIRECTORY d INSTALLED' "unknown argument(s) 'INSTALLED'"
bad 'p SOURCES a.cpp DESTINATION lib/x' "DESTINATION lib/x without INSTALL"
bad 'p SOURCES a.cpp INSTALL DESTINATION' "DESTINATION given without a value"
bad 'p SOURCES a.cpp OUTPUT_DIRECTORY' "OUTPUT_DIRECTORY given without a value"
echo "PASS: the installed package builds plugins that the installed wick loads; bad wick_add_plugin arguments are named"
