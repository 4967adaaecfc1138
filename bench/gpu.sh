#!/usr/bin/env bash
# The GPU benchmarks in one run, on the device machine, from the repository
# root (or anywhere: it finds its tree), within a time budget (GPU_BUDGET
# seconds, default 230: under 4 minutes on an H100), each part under
# `timeout`; raw output under OUT, a summary table last (also OUT/summary.txt):
#   1. bench/seeds.sh device=cuda, one process per seed (OUT/seeds_NNN.txt):
#      wick's peak allocated, reserved and device memory and s/step at full
#      depth (extrapolated from k and 2k layers per tower, measured for GPU_FULL)
#   2. bench/seeds_peers.py --device cuda (OUT/peers.txt): the same workloads
#      in transformers + PEFT, the same extrapolation
#   3. bench/lm_finetune.sh device=cuda (OUT/lm_finetune.txt): full, LoRA,
#      QLoRA in bf16, wick against transformers + PEFT, with MFU
#   4. wick plan on each seed recipe at its real shape, against the seed's card
#      (OUT/plan_NNN.txt): its estimate beside the peak seeds.sh measured
#   5. where a step's time goes: GPU_PROFILE's seeds and GPU_PROFILE_LM's
#      fine-tuning modes profiled in wick and in Python
#      (OUT/profile_{wick,py}_NAME.txt, traces in OUT/profile/)
#   WICK=path/to/wick PYTHON=path/to/python bench/gpu.sh OUT
# (PYTHON defaults to WICK_PYTHON, as the bundle's bin/wick-env exports it,
# then python3; WICK to this tree's build/bin/wick)
# Knobs (environment): GPU_BUDGET (230), GPU_SEEDS (004,002,000,001,003),
# GPU_FULL (seeds measured at full depth too; 004,002,000), GPU_PEERS_FULL
# (the same for the Python peers; GPU_FULL), GPU_K (2), GPU_PROFILE (seeds
# profiled at k layers in wick and in Python, side by side, NNNfull at full
# depth: 003; empty: none;
# GPU_SHARE_PROFILE, 45 s each side), GPU_PROFILE_LM (lm_finetune's modes
# profiled likewise: lora; GPU_SHARE_PROFILE_LM, 45 s each side: the Python
# side imports transformers first, and ran past 25 s on an H100's host),
# GPU_SHARE_NNN (seconds seed NNN may take in wick: 25 to 40; GPU_SHARE_003ws
# for 003 with a pre-Hopper card's cuBLAS workspaces, GPU_SHARE_LM for the
# fine-tuning, 90: its three modes ran past 70 s on an H100's host),
# GPU_PLAN_SEEDS (the seeds `wick plan` runs on; GPU_SEEDS;
# GPU_SHARE_PLAN_NNN, 30 s each, 75 for 003),
# PEAK_FLOPS (989e12, H100 SXM dense bf16), GPU_SKIP (parts to leave out:
# seeds,peers,lm,plan,profile); for a rehearsal on a CPU: GPU_DEVICE=cpu, GPU_PEERS_ARGS
# (--tiny), GPU_LM_ARGS (layers=2 steps=3).
set -uo pipefail
out=${1:?usage: WICK=... PYTHON=... bench/gpu.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
export WICK=${WICK:-$root/build/bin/wick}
PYTHON=${PYTHON:-${WICK_PYTHON:-python3}}
budget=${GPU_BUDGET:-230}
seeds=${GPU_SEEDS-004,002,000,001,003}
full=${GPU_FULL-004,002,000}
k=${GPU_K:-2}
peak_flops=${PEAK_FLOPS:-989e12}
skip=${GPU_SKIP:-}
device=${GPU_DEVICE:-cuda}
read -ra peers_args <<< "${GPU_PEERS_ARGS:-}"
read -ra lm_args <<< "${GPU_LM_ARGS:-}"
start=$(date +%s)
# PyTorch's cuBLAS workspace on a chip other than Hopper (CUBLAS_WORKSPACE_CONFIG
# :4096:2:16:8, 8.1 MiB), also asked of cuBLASLt (CUBLASLT_WORKSPACE_SIZE, KiB):
# what seed 003's 8 GB card gets, where an H100 or H200 gets 32 MiB
prehopper="CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8 CUBLASLT_WORKSPACE_SIZE=8320"
media=$(mktemp -d)
trap 'rm -rf "$media"' EXIT
times=$out/times.txt
: > "$times"

left() { echo $((start + budget - $(date +%s))); }
# part NAME SHARE RESERVE LOG CMD...: CMD under timeout for at most SHARE
# seconds, less if that would leave under RESERVE seconds for the parts after
# it; stdout and stderr to LOG; its exit status, seconds and limit to times.txt
part() {
  local name=$1 share=$2 reserve=$3 log=$4
  shift 4
  local t=$(( $(left) - reserve ))
  [ "$t" -gt "$share" ] && t=$share
  if [ "$t" -lt 5 ]; then
    echo "$name: skipped, out of time (budget ${budget}s)" | tee "$log" >> "$times"
    return 124
  fi
  local t0=$(date +%s) rc=0
  echo "== $name (limit ${t}s, $(left)s of the budget left)" >&2
  timeout -k 5 "$t" "$@" > "$log" 2>&1 || rc=$?
  echo "$name: rc=$rc seconds=$(( $(date +%s) - t0 )) limit=$t$([ $rc = 124 ] || [ $rc = 137 ] && echo ' TIMED OUT')" >> "$times"
  return $rc
}
wants() { [[ ",$skip," != *",$1,"* ]]; }

# the machine, for the record
{
  date -u
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"
  timeout 20 "$WICK" version 2>&1 || echo "wick version: failed"
  timeout 30 "$PYTHON" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''); \
print('transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 || echo "python: failed"
  timeout 20 "$PYTHON" -c "import bitsandbytes" > /dev/null 2>&1 && echo "bitsandbytes: present" || echo "bitsandbytes: absent"
  # what the first products take from the caching allocator (the seeds hold
  # about 64 MiB before their first step on the GPU that the CPU does not):
  # the same LibTorch as wick's, so the same cuBLAS / cuBLASLt workspaces;
  # PyTorch gives Hopper larger ones than other chips, so again with the
  # sizes it gives an 8-12 GB card (below: $prehopper)
  for ws in default prehopper; do
    [ "$device" = cuda ] || break
    echo "cuBLAS workspaces: $ws"
    if [ $ws = default ]; then w=(); else w=($prehopper); fi
    env "${w[@]}" timeout 60 "$PYTHON" - <<'PY' 2>&1
import torch
a = torch.randn(256, 256, device="cuda")
b = a.to(torch.bfloat16)
torch.cuda.synchronize()
m0 = torch.cuda.memory_allocated()
(a @ a).sum().item()
m1 = torch.cuda.memory_allocated()
(b @ b).sum().item()
m2 = torch.cuda.memory_allocated()
with torch.autocast("cuda", torch.bfloat16):
    torch.nn.functional.linear(a, a, a[0]).sum().item()
m3 = torch.cuda.memory_allocated()
print(f"allocator bytes the first products keep (cuBLAS workspaces): fp32 mm {(m1 - m0) / 2**20:.1f} MiB, "
      f"then bf16 mm {(m2 - m1) / 2**20:.1f} MiB, then bf16 linear with bias {(m3 - m2) / 2**20:.1f} MiB")
PY
  done
  # the device memory of a CUDA context with nothing allocated, each side's
  # at its start (wick's process held about 70 MiB more outside its
  # allocator than Python's in bench/lm_finetune on the H200 of 2026-11-28)
  if [ "$device" = cuda ]; then
    echo "device memory in use with a bare CUDA context (nothing allocated; CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}):"
    timeout 60 "$PYTHON" -c "import torch; f, t = torch.cuda.mem_get_info(); print(f'  python: {(t - f) / 2**20:.0f} MiB')" 2>&1
    printf '%s\n' 'local wick = require "wick"' 'local m = wick.memory(true)' \
      'print(string.format("  wick: %.0f MiB", (m.cuda_device_used or 0) / 2^20))' > "$media/context.lua"
    timeout 60 "$WICK" run "$media/context.lua" 2>&1
  fi
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt" >&2

# 1. the seeds in wick, one process each (the media made by the first)
export SEEDS_MEDIA=$media
declare -A share=([004]=25 [002]=30 [000]=35 [001]=40 [003]=40)
IFS=, read -ra seed_list <<< "$seeds"
if wants seeds; then
  n=${#seed_list[@]}
  i=0
  for s in "${seed_list[@]}"; do
    i=$((i + 1))
    f=""
    [[ ",$full," == *",$s,"* ]] && f="full=$s"
    # after this seed: 10 s for each seed left, the peers, the fine-tuning, the plans
    v=GPU_SHARE_$s
    part "seeds $s" "${!v:-${share[$s]:-40}}" $(( (n - i) * 10 + 45 + 30 + 25 )) "$out/seeds_$s.txt" \
      bench/seeds.sh device=$device seeds=$s k=$k $f
  done
fi
# seed 003 again with the cuBLAS workspaces of its 8 GB card (not a Hopper):
# extrapolated from k and 2k layers, its rows named 003ws
if wants seeds && [ "$device" = cuda ] && [[ ",$seeds," == *",003,"* ]]; then
  part "seeds 003ws" "${GPU_SHARE_003ws:-40}" 100 "$out/seeds_003ws.txt" env $prehopper \
    bench/seeds.sh device=$device seeds=003 k=$k
  sed -i 's/^\(RESULT\|MEASURE\) seed=003 /\1 seed=003ws /' "$out/seeds_003ws.txt"
fi
# the media, if no seed made them (the plans read them)
[ -f "$media/clips/manifest.csv" ] ||
  "$WICK" make-clips "$media/clips" --classes 6 --per-class 40 --size 64x48 --seconds 4 --fps 25 --no-extras > /dev/null 2>&1

# 2. the same workloads in transformers + PEFT
wants peers && part peers 90 55 "$out/peers.txt" "$PYTHON" -u bench/seeds_peers.py --device "$device" --seeds "$seeds" \
  --k "$k" --full "${GPU_PEERS_FULL-$full}" "${peers_args[@]}"

# 3. fine-tuning a decoder LM: full, LoRA, QLoRA, bf16 (wick against transformers + PEFT)
wants lm && part lm_finetune "${GPU_SHARE_LM:-90}" 25 "$out/lm_finetune.txt" bench/lm_finetune.sh "$WICK" "$PYTHON" device="$device" \
  peak_flops="$peak_flops" "${lm_args[@]}"

# 4. wick plan on each seed at its real shape, against its card
declare -A file=([000]=000_microvlm.lua [001]=001_video_llm.lua [002]=002_car_clip.lua [003]=003_llava_qlora.lua
  [004]=004_gearhead_lm.lua)
IFS=, read -ra plan_list <<< "${GPU_PLAN_SEEDS-$seeds}"
if wants plan; then
  n=${#plan_list[@]}
  i=0
  for s in "${plan_list[@]}"; do
    i=$((i + 1))
    card=12GiB
    [ "$s" = 003 ] && card=8GiB
    # 003 builds a 7 B model on the host first (its random draw is serial:
    # about 1 s a layer) before one step of 1.3 s and five more
    ps=30
    [ "$s" = 003 ] && ps=75
    ps_var=GPU_SHARE_PLAN_$s
    part "plan $s" "${!ps_var:-$ps}" $(( (n - i) * 5 + 3 )) "$out/plan_$s.txt" "$WICK" plan "configs/seeds/${file[$s]}" \
      --device-memory $card clips="$media/clips" shape=real out="$media/plan-$s" device="$device"
  done
fi

# 5. where a step's time goes, wick and its Python peer side by side, each
# seed of GPU_PROFILE at k layers under PyTorch's profiler (PROFILE lines in
# OUT/profile_{wick,py}_NNN.txt, the traces under OUT/profile/)
# (a seed named NNNfull: at full depth)
IFS=, read -ra prof_list <<< "${GPU_PROFILE-003}"
if wants profile; then
  for s in "${prof_list[@]}"; do
    [ -n "$s" ] || continue
    seed=${s%full} pw=() pp=()
    [ "$seed" != "$s" ] && pw=(profile_full=1) && pp=(--profile-full)
    part "profile $s" "${GPU_SHARE_PROFILE:-45}" 0 "$out/profile_wick_$s.txt" bench/seeds.sh device=$device seeds=$seed \
      k=$k profile="$out/profile" profile_only=1 "${pw[@]}"
    part "profile $s (python)" "${GPU_SHARE_PROFILE:-45}" 0 "$out/profile_py_$s.txt" "$PYTHON" -u bench/seeds_peers.py \
      --device "$device" --seeds "$seed" --k "$k" --profile "$out/profile" --profile-only "${pp[@]}" "${peers_args[@]}"
  done
  # and bench/lm_finetune's modes of GPU_PROFILE_LM (its steps 2-12, wick and transformers + PEFT)
  IFS=, read -ra prof_lm <<< "${GPU_PROFILE_LM-lora}"
  py_lm=()
  for kv in "${lm_args[@]}"; do py_lm+=("--${kv%%=*}" "${kv#*=}"); done
  for m in "${prof_lm[@]}"; do
    [ -n "$m" ] || continue
    part "profile lm_$m" "${GPU_SHARE_PROFILE_LM:-45}" 0 "$out/profile_wick_lm_$m.txt" "$WICK" run bench/lm_finetune.lua \
      mode="$m" device="$device" profile="$out/profile" "${lm_args[@]}"
    part "profile lm_$m (python)" "${GPU_SHARE_PROFILE_LM:-45}" 0 "$out/profile_py_lm_$m.txt" "$PYTHON" -u \
      bench/lm_finetune.py "$m" --device "$device" --profile "$out/profile" "${py_lm[@]}"
  done
  # the traces, not the profiled runs' checkpoints; a trace too large to bring back is left out, said
  if [ -d "$out/profile" ]; then
    find "$out/profile" -mindepth 2 -maxdepth 2 -type d -name checkpoints -exec rm -rf {} +
    find "$out/profile" -name '*.json' -size +80M -printf 'profile: trace %p left out (%s bytes)\n' -delete >> "$times"
  fi
fi

# 6. seed 003 measured at full depth (the 7 B model built and quantized on the
# host first: minutes), its rows named 003full, if the budget has room; at
# full depth alone (full_only=1), its k-layer rows being part 1's (an
# extrapolation from 1 and 2 layers counted the block input fetched back
# ahead, which 2 layers and more hold once, as a cost per layer)
if wants seeds && [ "$device" = cuda ] && [[ ",$seeds," == *",003,"* ]] && [[ ",$full," != *",003,"* ]]; then
  part "seeds 003full" "${GPU_SHARE_003full:-180}" 0 "$out/seeds_003full.txt" bench/seeds.sh device=$device seeds=003 \
    full=003 full_only=1
  sed -i 's/^\(RESULT\|MEASURE\) seed=003 /\1 seed=003full /' "$out/seeds_003full.txt"
fi

# 7. the same fine-tuning at a width where products, not launches, take the
# time (1,024 wide, 8 layers, 4 x 512 tokens), if the budget has room
[ "$device" = cuda ] && wants lm && part lm_finetune_wide "${GPU_SHARE_LM:-90}" 0 "$out/lm_finetune_wide.txt" \
  bench/lm_finetune.sh "$WICK" "$PYTHON" device="$device" peak_flops="$peak_flops" hidden=1024 inter=2816 layers=8 \
  heads=16 seq=512

# the summary
"$PYTHON" - "$out" "$seeds" "$k" > "$out/summary.txt" 2>&1 <<'PY' || { echo "summary failed:"; cat "$out/summary.txt"; grep -h '^RESULT\|^LM ' "$out"/*.txt; }
import glob, os, re, sys

out, seeds, k = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
GiB = 2 ** 30


def fields(line):
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))


def results(path, side=None):
    got = {}
    if not os.path.exists(path):
        return got
    for line in open(path, errors="replace"):
        if line.startswith("RESULT "):
            f = fields(line)
            if "reason" in f and "error" not in f:  # a variant that did not run (RESULT ... n/a reason=...)
                continue
            if side is None or f.get("side") == side:
                got[f.get("seed")] = f
    return got


def num(f, key):
    try:
        return float(f.get(key, "n/a"))
    except (TypeError, ValueError):
        return None


def g(x):
    return f"{x / GiB:.3f}" if x else "n/a"


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


wick = {}
for path in glob.glob(os.path.join(out, "seeds_*.txt")):
    wick.update(results(path))
py = results(os.path.join(out, "peers.txt"), "python")
plan, plan_notes = {}, []
for s in seeds:
    p = os.path.join(out, f"plan_{s}.txt")
    if os.path.exists(p):
        t = open(p, errors="replace").read()
        m = re.search(r"estimate as given: (\d+) bytes", t)
        plan[s] = float(m.group(1)) if m else None
        if not m:
            why = [l for l in t.splitlines() if "error" in l or "skipped" in l]
            plan_notes.append(f"plan {s}: no estimate: " + (why[-1].strip() if why else "see plan_" + s + ".txt"))
times = open(os.path.join(out, "times.txt")).read() if os.path.exists(os.path.join(out, "times.txt")) else ""

# every run both sides measured at the same depth: like for like, no extrapolation
def measures(paths, side=None):
    got = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        for line in open(path, errors="replace"):
            if line.startswith("MEASURE "):
                f = fields(line)
                if side is None or f.get("side") == side:
                    got[(f.get("seed"), f.get("depth"))] = f
    return got


wm = measures(glob.glob(os.path.join(out, "seeds_*.txt")))
pm = measures([os.path.join(out, "peers.txt")], "python")


def speed(s, w, p):
    """Python's s/step over wick's: at full depth where both measured it there,
    else at the deepest depth both measured (marked *): an extrapolated time
    multiplies differences of single runs' times by the layers left."""
    ws, ps = num(w, "sps"), num(p, "sps")
    if w.get("how") == "measured" and p.get("how") == "measured":
        return ratio(ps, ws)
    both = [(num(wm[key], "params") or 0, key) for key in wm if key[0] == s and key in pm
            and num(wm[key], "sps") and num(pm[key], "sps")]
    if not both:  # one side's time extrapolated (~)
        return ratio(ps, ws) + ("~" if ps and ws else "")
    key = max(both)[1]
    return ratio(num(pm[key], "sps"), num(wm[key], "sps")) + "*"


print(f"seeds on the GPU: full depth (extrapolated per layer from {k} and {2 * int(k)} layers, or measured); GiB; "
      "s/step: one optimizer step of 2 micro-batches")
hdr = ("seed", "wick peak", "py peak", "w/p", "wick resv", "py resv", "wick dev", "py dev", "wick s/st", "py s/st",
       "py/wick", "plan est", "plan/wick", "goal", "fits", "card", "fits", "how (wick; python)")
fmt = "{:<6} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>5} {:<4} {:>4} {:<4} {}"
print(fmt.format(*hdr))
names = []
for s in seeds:
    names += [s, s + "fb"] if s == "004" else [s]
    for extra in ("full", "ws"):  # measured at full depth; with a pre-Hopper card's cuBLAS workspaces
        if s + extra in wick:
            names.append(s + extra)
for s in names:
    w, p = wick.get(s, {}), py.get(s, {})
    if not w and not p and s.endswith("fb"):
        continue
    if "error" in w or not w:
        wtxt = ("error: " + w["error"]) if "error" in w else "no result"
    else:
        wtxt = w.get("how", "")
    ptxt = ("error: " + p["error"]) if "error" in p else (p.get("how", "") + (" " + p["variant"] if "variant" in p else "")) if p else "no result"
    wp, pp = num(w, "peak"), num(p, "peak")
    ws, ps = num(w, "sps"), num(p, "sps")
    est = plan.get(s)
    goal, card = num(w, "goal") or num(p, "goal"), num(w, "card") or num(p, "card")
    print(fmt.format(s, g(wp), g(pp), ratio(wp, pp), g(num(w, "reserved")), g(num(p, "reserved")), g(num(w, "device")),
                     g(num(p, "device")), f"{ws:.4f}" if ws else "n/a", f"{ps:.4f}" if ps else "n/a",
                     speed(s, w, p), g(est), ratio(est, wp), f"{goal / GiB:.2f}" if goal else "n/a",
                     w.get("fits_goal", "n/a"), f"{card / GiB:.0f}" if card else "n/a", w.get("fits_card", "n/a"),
                     f"{wtxt}; {ptxt}"[:120]))
print("w/p: wick's peak allocated over Python's; py/wick: Python's seconds per step over wick's (above 1: wick faster),")
print("at full depth where both measured it, else (*) at the deepest depth both measured (the s/step columns: full depth),")
print("~ where no depth was measured by both (one side's time extrapolated);")
print("plan est: `wick plan`'s estimate as given at the real shape; fits: wick's peak against the goal, its device memory")
print("against the card. 003's Python peer: qlora (bitsandbytes' 4-bit NF4) where bitsandbytes imports, else")
print("bf16-lora (its frozen weights in bf16: not the seed's 4-bit); see how (wick; python). 003ws: 003 with the")
print("cuBLAS/cuBLASLt workspaces PyTorch gives a card that is not a Hopper (8.1 MiB each, not 32: its 8 GB card's);")
print("003full: 003 measured at full depth.")
for n in plan_notes:
    print(n)

if wm or pm:
    print("")
    print("each run at the depth both measured (GiB, s/step):")
    f2 = "{:<6} {:<34} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}"
    print(f2.format("seed", "depth", "wick peak", "py peak", "w/p", "wick resv", "py resv", "wick dev", "py dev",
                    "wick s/st", "py s/st", "py/wick"))
    for key in sorted(set(wm) | set(pm), key=lambda x: (str(x[0]), str(x[1]))):
        w, p = wm.get(key, {}), pm.get(key, {})
        wp, pp, ws, ps = num(w, "peak"), num(p, "peak"), num(w, "sps"), num(p, "sps")
        print(f2.format(str(key[0]), str(key[1]), g(wp), g(pp), ratio(wp, pp), g(num(w, "reserved")),
                        g(num(p, "reserved")), g(num(w, "device")), g(num(p, "device")),
                        f"{ws:.4f}" if ws else "n/a", f"{ps:.4f}" if ps else "n/a", ratio(ps, ws)))
for lm, shape in ((os.path.join(out, "lm_finetune.txt"), "6 layers, 512 wide, 4 x 256 tokens"),
                  (os.path.join(out, "lm_finetune_wide.txt"), "8 layers, 1,024 wide, 4 x 512 tokens")):
    if not os.path.exists(lm):
        continue
    print("")
    print(f"decoder LM fine-tuning (bench/lm_finetune.sh device=cuda, bf16 autocast; {shape}):")
    print(f"{'mode':<6} {'wick tok/s':>11} {'py tok/s':>11} {'w/p':>6} {'wick peak':>10} {'py peak':>10} {'wick MFU':>9} {'py MFU':>9}")
    notes = []
    for line in open(lm, errors="replace"):
        if line.startswith("LM "):
            f = fields(line)
            wt, pt = num(f, "wick_tps"), num(f, "python_tps")
            print(f"{f.get('mode', '?'):<6} {f.get('wick_tps', 'n/a'):>11} {f.get('python_tps', 'n/a'):>11} "
                  f"{ratio(wt, pt):>6} {g(num(f, 'wick_peak')):>10} {g(num(f, 'python_peak')):>10} "
                  f"{f.get('wick_mfu', 'n/a'):>9} {f.get('python_mfu', 'n/a'):>9}")
        elif ": n/a: " in line:
            notes.append(line.rstrip())
    for n in notes:
        print(n)
# where a step's time goes (PROFILE lines of bench/seeds.lua and bench/seeds_peers.py)
prof = {}
for path in sorted(glob.glob(os.path.join(out, "profile_*_*.txt"))):
    for line in open(path, errors="replace"):
        if line.startswith(("PROFILE ", "PROFILE_OP ", "PROFILE_RT ")):
            f = fields(line)
            entry = prof.setdefault((f.get("seed"), f.get("side")), {"ops": [], "rt": []})
            if line.startswith("PROFILE "):
                entry.update(f)
            else:
                entry["ops" if line.startswith("PROFILE_OP ") else "rt"].append(f)
for seed in sorted({k[0] for k in prof}):
    w, p = prof.get((seed, "wick"), {"ops": [], "rt": []}), prof.get((seed, "python"), {"ops": [], "rt": []})
    print("")
    print(f"where a step's time goes, {'bench/lm_finetune ' if str(seed).startswith('lm_') else 'seed '}{seed} at {w.get('depth') or p.get('depth') or '?'} (ms per step; "
          "device busy: the kernels' and copies' time):")
    print(f"  wick:   {w.get('ms_per_step', 'n/a')} ms a step, device busy {w.get('device_busy', 'n/a')}; host: data "
          f"{w.get('data', 'n/a')}, forward {w.get('forward', 'n/a')}, backward {w.get('backward', 'n/a')}, optimizer "
          f"{w.get('optimizer', 'n/a')}")
    print(f"  python: {p.get('ms_per_step', 'n/a')} ms a step, device busy {p.get('device_busy', 'n/a')}")
    print(f"  {'wick: operator':<50} {'ms':>8} {'calls':>7} | {'python: operator':<50} {'ms':>8} {'calls':>7}")
    for table in ("ops", "rt"):
        if table == "rt" and (w["rt"] or p["rt"]):
            print(f"  {'wick: CUDA runtime call':<50} {'ms':>8} {'calls':>7} | {'python: CUDA runtime call':<50} "
                  f"{'ms':>8} {'calls':>7}")
        for i in range(max(len(w[table]), len(p[table]))):
            a = w[table][i] if i < len(w[table]) else {}
            b = p[table][i] if i < len(p[table]) else {}
            print(f"  {a.get('name', '').strip(chr(34))[:50]:<50} {a.get('ms', ''):>8} {a.get('calls', ''):>7} | "
                  f"{b.get('name', '').strip(chr(34))[:50]:<50} {b.get('ms', ''):>8} {b.get('calls', ''):>7}")
print("")
print("parts (exit status, seconds, limit):")
print(times.rstrip())
PY
echo "total: $(( $(date +%s) - start )) s of a ${budget} s budget" >> "$out/summary.txt"
cat "$out/summary.txt"
