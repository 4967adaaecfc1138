"""One row of bench/lm_finetune.sh, in Python: the same decoder as a
transformers LlamaForCausalLM, fine-tuned fully or with PEFT's LoRA on random
tokens for a few AdamW steps; prints tokens per second (steps after the first)
and peak memory.
  python bench/lm_finetune.py MODE [--device cpu|cuda] [--steps N] [--micro 4] [--seq 256]
      [--hidden 512] [--inter 1408] [--layers 6] [--heads 8] [--vocab 257] [--precision fp32|bf16-mixed]
      [--profile DIR]
On cuda: torch.autocast bf16 over fp32 weights (wick's bf16-mixed) unless
--precision says otherwise, 12 steps, the first a warm-up, each step timed
to the device's end (wick's side reads each step's loss at its end), tokens
per second from the median step; peak: torch.cuda.max_memory_allocated,
reserved: max_memory_reserved, device: the process's device memory
(cudaMemGetInfo's used, less the allocator's reserve now, plus its peak:
wick's run.memory.device_peak). QLoRA needs bitsandbytes' CUDA kernels: n/a,
with the reason, where they are missing. One line:
  RESULT mode=full tps=T peak=B reserved=B device=B rss=B params=N trainable=N
or RESULT mode=qlora n/a reason="..."."""
import argparse
import importlib.util
import resource
import statistics
import sys
import tempfile
import time

import torch


def na(mode, reason):
    print(f'RESULT mode={mode} n/a reason="{reason}"')


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["full", "lora", "qlora"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--precision", default=None, choices=["fp32", "bf16-mixed"])
    p.add_argument("--profile", metavar="DIR", help="steps 2 to N under torch.profiler instead: the trace in "
                   "DIR/python-lm_MODE.json, PROFILE lines (bench/profile_lines.py) in place of the RESULT line")
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    steps = a.steps or (12 if cuda else 6)
    precision = a.precision or ("bf16-mixed" if cuda else "fp32")
    mode, micro, seq = a.mode, a.micro, a.seq
    if cuda and not torch.cuda.is_available():
        na(mode, f"--device {a.device}: torch sees no CUDA device")
        return
    if mode == "qlora":
        if not cuda:
            na(mode, "bitsandbytes' 4-bit layers need a CUDA device")
            return
        if importlib.util.find_spec("bitsandbytes") is None:
            na(mode, "bitsandbytes is not installed")
            return
    from transformers import LlamaConfig, LlamaForCausalLM
    dev = torch.device(a.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    if mode == "qlora":
        # random weights through a folder: bitsandbytes quantizes as from_pretrained loads
        from transformers import BitsAndBytesConfig
        with tempfile.TemporaryDirectory() as d:
            LlamaForCausalLM(cfg).save_pretrained(d)
            q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
            model = LlamaForCausalLM.from_pretrained(d, quantization_config=q, device_map={"": (dev.index or 0) if cuda else "cpu"})
    else:
        model = LlamaForCausalLM(cfg).to(dev)
    if mode != "full":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, min(256, a.vocab), (micro, seq), generator=g).to(dev) for _ in range(steps)]
    autocast = (torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else torch.autocast(device_type=dev.type, enabled=False))

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    if a.profile:
        import os
        from profile_lines import print_profile
        os.makedirs(a.profile, exist_ok=True)
        trace = os.path.join(a.profile, f"python-lm_{mode}.json")
        step(batches[0])
        sync()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for ids in batches[1:]:
                step(ids)
                sync()
            seconds = time.perf_counter() - t0
        prof.export_chrome_trace(trace)
        print_profile(f"lm_{mode}", f"depth=layers={a.layers}", prof, steps - 1, seconds / max(1, steps - 1), cuda, trace)
        return
    tokens, seconds = 0, 0.0
    if cuda:
        # step 1 warms up; steps 2..N each timed to the device's end, as wick's side reads each step's loss at its
        # end (log_every = 1) and as transformers' Trainer waits on each step's loss (its nan/inf filter)
        # (the median step, as wick's side takes it)
        step(batches[0])
        sync()
        times = []
        for ids in batches[1:]:
            t0 = time.perf_counter()
            step(ids)
            sync()
            times.append(time.perf_counter() - t0)
        tokens, seconds = micro * (seq - 1), statistics.median(times)
    else:
        for i, ids in enumerate(batches):
            t0 = time.perf_counter()
            step(ids)
            dt = time.perf_counter() - t0
            if i > 0:
                tokens += micro * (seq - 1)
                seconds += dt
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = reserved = device = "n/a"
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev)
        reserved = torch.cuda.max_memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        device = total - free - torch.cuda.memory_reserved(dev) + reserved
    print(f"RESULT mode={mode} tps={tokens / seconds:.1f} peak={peak} reserved={reserved} device={device} rss={rss} "
          f"params={params} trainable={trainable} steps={steps} precision={precision}")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one row's failure: said on its line, the table goes on
        msg = str(e).replace('"', "'").replace("\n", " ")[:300]
        print(f'RESULT mode={sys.argv[1] if len(sys.argv) > 1 else "?"} n/a reason="{type(e).__name__}: {msg}"')
        sys.exit(1)
