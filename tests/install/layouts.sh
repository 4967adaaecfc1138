#!/usr/bin/env bash
# wick configured as distributions configure it: CMAKE_INSTALL_LIBDIR
# lib/x86_64-linux-gnu (Debian's multiarch) by default, lib64 (RPM
# distributions) or any other when named. Each is built beside the test's
# build folder (the same compiler flags, so ccache serves the objects),
# installed, moved to another folder and checked by check_prefix.sh. A libdir
# outside the prefix is refused at configure time.
# The suite builds multiarch alone: its libdir is two folders deep and not
# named lib, so a path that assumes either fails there; lib64, one folder
# deep, adds a build of about 2 minutes and no case (layouts.sh BUILD SRC
# multiarch=lib/x86_64-linux-gnu lib64=lib64 runs both).
#   layouts.sh BUILD_DIR SOURCE_DIR [NAME=LIBDIR ...]
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
shift 2
layouts=("$@")
((${#layouts[@]})) || layouts=(multiarch=lib/x86_64-linux-gnu)
for l in "${layouts[@]}"; do
  [[ "${l%%=*}" =~ ^[A-Za-z0-9_]+$ && "$l" == *=* ]] || { echo "layouts.sh: '$l' is not NAME=LIBDIR (NAME: letters, digits, _)"; exit 2; }
done
tmp=$(mktemp -d)
made=()  # only the build folders this run made are removed
cleanup() { rm -rf "$tmp"; for b in "${made[@]}"; do rm -rf "$b"; done; }
trap cleanup EXIT
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
# scripts/setup's ccache settings; sibling build folders at the build's depth
# give the same relative paths, so the compiles are cache hits
export CCACHE_BASEDIR=$src CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_COMPILERCHECK=content CCACHE_NOHASHDIR=1 PATH=/usr/local/cuda/bin:$PATH
opts=(-DCMAKE_BUILD_TYPE="$(cache CMAKE_BUILD_TYPE)" -DCMAKE_PREFIX_PATH="$(cache CMAKE_PREFIX_PATH)"
      -DWICK_WITH_CUDA="$(cache WICK_WITH_CUDA)" -DWICK_BUILD_TESTS=OFF -Wno-dev)
[ -n "$(cache CMAKE_CXX_COMPILER_LAUNCHER)" ] && opts+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$(cache CMAKE_CXX_COMPILER_LAUNCHER)")
[ -n "$(cache CMAKE_CUDA_COMPILER)" ] && opts+=(-DCMAKE_CUDA_COMPILER="$(cache CMAKE_CUDA_COMPILER)")
gen=(-G "$(cache CMAKE_GENERATOR)")

# refused: a libdir that is not under the prefix
if cmake -S "$src" -B "$tmp/refused" "${gen[@]}" "${opts[@]}" -DCMAKE_INSTALL_PREFIX=/opt/wick \
     -DCMAKE_INSTALL_LIBDIR=/usr/lib64 > "$tmp/refused.log" 2>&1; then
  echo "FAIL: CMAKE_INSTALL_LIBDIR=/usr/lib64 outside the prefix was accepted"; exit 1
fi
grep -q "CMAKE_INSTALL_LIBDIR=/usr/lib64 is not a folder inside" "$tmp/refused.log" ||
  { cat "$tmp/refused.log"; echo "FAIL: the refusal does not name CMAKE_INSTALL_LIBDIR"; exit 1; }

for l in "${layouts[@]}"; do
  name=${l%%=*} libdir=${l#*=}
  b=$build-layout-$name
  [ -e "$b" ] && { echo "FAIL: $b exists already (another run's, or yours): remove it first"; exit 1; }
  made+=("$b")
  cmake -S "$src" -B "$b" "${gen[@]}" "${opts[@]}" -DCMAKE_INSTALL_LIBDIR="$libdir" > "$tmp/$name.configure.log" 2>&1 ||
    { cat "$tmp/$name.configure.log"; echo "FAIL: configure with CMAKE_INSTALL_LIBDIR=$libdir"; exit 1; }
  # one job: the objects come from ccache, and the rest of the suite runs beside this test
  cmake --build "$b" -j 1 > "$tmp/$name.build.log" 2>&1 ||
    { grep -E "error|Error" -A5 "$tmp/$name.build.log" | head -40; echo "FAIL: build with CMAKE_INSTALL_LIBDIR=$libdir"; exit 1; }
  # the build tree has the installed layout
  test -x "$b/bin/wick" && test -d "$b/$libdir/wick/plugins" ||
    { echo "FAIL: the build tree of $name has no bin/wick or $libdir/wick/plugins"; exit 1; }
  cmake --install "$b" --prefix "$tmp/installed-$name" > "$tmp/$name.install.log"
  test -f "$tmp/installed-$name/$libdir/wick/plugins/decoder_lm.so" ||
    { echo "FAIL: $name: no plugins in $libdir/wick/plugins"; exit 1; }
  mv "$tmp/installed-$name" "$tmp/moved-$name"
  bash "$src/tests/install/check_prefix.sh" "$tmp/moved-$name" "$libdir" "$src"
  rm -rf "$b"
done
echo "PASS: installs with ${layouts[*]} find their files after being moved"
