#!/usr/bin/env bash
# How close `wick plan`'s estimate is to the peak a real run measures, for
# the built-in recipes on this machine's CPU: the estimate for the recipe as
# given against run.json's peak held by tensors during steps, less what was
# held before the first step (data sets in memory: host memory on a GPU).
#   bench/plan_check.sh [path/to/wick]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf "%-22s %14s %14s %8s\n" recipe "plan (bytes)" "run (bytes)" error
for spec in "default.lua max_steps=40" "lm_scratch.lua max_steps=6"; do
  set -- $spec
  recipe=$1; shift
  est=$("$wick" plan "$here/../configs/$recipe" out="$tmp/$recipe" "$@" | sed -n 's/.*estimate as given: \([0-9]*\) bytes.*/\1/p')
  "$wick" run "$here/../configs/$recipe" out="$tmp/$recipe" "$@" quiet=true > /dev/null
  run=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['memory']; print(m['peak']-m['other'])" "$tmp/$recipe/run.json")
  printf "%-22s %14s %14s %7.1f%%\n" "$recipe" "$est" "$run" "$(echo "100 * ($est - $run) / $run" | bc -l)"
done
