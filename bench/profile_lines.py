"""The PROFILE lines of a run under torch.profiler, as bench/gpu.sh reads them beside wick's
(bench/profile_lines.lua):
  PROFILE seed=NAME side=python DEPTH steps=N ms_per_step=.. device_busy=.. trace=..
  PROFILE_OP seed=NAME side=python rank=I ms=.. calls=.. name="..."   (kernels and copies by device time on a
                                                                       GPU; operators by self time on a CPU)
  PROFILE_RT seed=NAME side=python rank=I ms=.. calls=.. name="..."   (CUDA runtime calls: launches, copies, waits)
(ms and calls per step; `steps`: the steps the profiler saw)."""
import torch


def print_profile(name, depth, prof, steps, seconds_per_step, cuda, trace, say=print):
    n = max(1, steps)
    rows = prof.key_averages()
    if cuda:
        dev = [e for e in rows if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in dev)
        ranked = sorted(dev, key=lambda e: -e.self_device_time_total)
        ms = lambda e: e.self_device_time_total  # noqa: E731
    else:
        busy = 0.0
        ranked = sorted(rows, key=lambda e: -e.self_cpu_time_total)
        ms = lambda e: e.self_cpu_time_total  # noqa: E731
    say(f"PROFILE seed={name} side=python {depth} steps={n} ms_per_step={seconds_per_step * 1e3:.3f} "
        f"device_busy={busy / 1e3 / n:.3f} trace={trace}")
    for i, e in enumerate(ranked[:15]):
        say(f'PROFILE_OP seed={name} side=python rank={i + 1} ms={ms(e) / 1e3 / n:.3f} calls={e.count / n:.1f} '
            f'name="{e.key[:200]}"')
    if cuda:
        runtime = sorted((e for e in rows if e.key.startswith("cuda") and e.device_type != torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.cpu_time_total)
        for i, e in enumerate(runtime[:10]):
            say(f'PROFILE_RT seed={name} side=python rank={i + 1} ms={e.cpu_time_total / 1e3 / n:.3f} '
                f'calls={e.count / n:.1f} name="{e.key[:200]}"')
