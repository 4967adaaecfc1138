"""The seeds' workloads (configs/seeds/) in Python, as their users write them:
transformers models built from configs with random weights (no downloads),
PEFT for LoRA, torch.autocast, gradient checkpointing, torch's AdamW; each at
the seed's settings (micro-batch, precision, checkpointing, LoRA rank and
targets, frozen parts, clipping) and the shapes wick's data gives (visual
tokens, caption lengths, 100-frame clips), on the same card as bench/seeds.lua.

As bench/seeds.lua does, each optimizer step is a window of 2 micro-batches,
every tower (the seed's depth options) runs at k layers, then each at 2k, and
the full depth is extrapolated per layer of each tower; --full SEEDS also
measures those at full depth. On cuda: 5 steps a run, the first a warm-up,
the device synchronised after each step and the median of the timed steps'
times the step's time (as bench/seeds.lua takes wick's), the allocator emptied and
its peaks reset between runs; peak: torch.cuda.max_memory_allocated, reserved:
max_memory_reserved, device: the process's device memory (cudaMemGetInfo's
used less the reserve now, plus the reserve's peak: wick's device_peak).

  python bench/seeds_peers.py [--device cuda] [--seeds 004,002,000,001,003] [--k 2] [--full 004,002]
                              [--steps 5] [--tiny]
--tiny: every seed at toy widths (runs in seconds on a CPU; a test of the
script, not a measure). One line per seed (bytes; n/a where not counted):
  RESULT seed=004 side=python how=extrapolated peak=B reserved=B device=B sps=S samples_per_s=X tokens_per_s=X
or RESULT seed=... error="...". The seeds' bitsandbytes parts (003's 4-bit
NF4 weights, 000's and 003's 8-bit AdamW) are used where bitsandbytes imports
(the device bundle carries it; --no-bnb: not used); else torch's plain ways
run, and the line says so (variant=bf16-lora, optim=torch.AdamW, and a line
RESULT seed=003 variant=qlora n/a reason="...").
"""
import argparse
import gc
import math
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from profile_lines import print_profile

warnings.filterwarnings("ignore")
GiB = 2 ** 30
LORA_LM = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def say(*a):
    print(*a, flush=True)


def checkpointing(model):
    """Activation checkpointing of every block the model declares (non-reentrant,
    as transformers recommends with PEFT)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def rand_ids(b, n, vocab, gen, avoid=()):
    ids = torch.randint(0, vocab, (b, n), generator=gen)
    for t in avoid:
        ids[ids == t] = (t + 1) % vocab
    return ids


# ---------------------------------------------------------------------------
# The seeds. Each: name, title, towers (depth option -> full depth), card and
# goal (bytes), settings, and build(depth, dev, tiny) -> Work: model, the
# trained parameters, a micro-batch maker and the loss of a micro-batch.


class Work:
    def __init__(self, model, params, batch, loss, autocast, clip, lr, wd, samples, tokens, note="", optim="adamw",
                 variant=""):
        self.model, self.params, self.batch, self.loss = model, params, batch, loss
        self.autocast, self.clip, self.lr, self.wd = autocast, clip, lr, wd
        self.samples, self.tokens, self.note = samples, tokens, note
        self.optim, self.variant = optim, variant


def has_bnb():
    """bitsandbytes importable (the device bundle may carry it): 4-bit NF4
    layers and 8-bit AdamW as the seeds' own scripts use them."""
    if NO_BNB:
        return False
    try:
        import bitsandbytes  # noqa: F401
        return True
    except Exception:
        return False


NO_BNB = False  # --no-bnb: the plain torch ways even where bitsandbytes is there


def quantized_4bit(model, dev):
    """A random-weight model as a QLoRA user gets it: saved, then read back by
    from_pretrained with bitsandbytes' 4-bit NF4 (double-quantized constants,
    bf16 compute), every linear layer quantized but the output head."""
    import tempfile
    from transformers import BitsAndBytesConfig
    cls = type(model)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        return cls.from_pretrained(d, quantization_config=q, device_map={"": (dev.index or 0) if dev.type == "cuda" else "cpu"}, dtype=torch.bfloat16)


def seed004(depth, dev, tiny, optim="adamw"):
    """34 M decoder LM from scratch: LLaMA-style, hidden 512, 8 layers, vocab
    16,384, tied head; micro-batch 2 x 512 packed tokens, bf16 autocast,
    checkpointing, clip 1.0, AdamW 3e-4."""
    from transformers import LlamaConfig, LlamaForCausalLM
    s = dict(vocab=16384, hidden=512, inter=1408, heads=8, seq=512)
    if tiny:
        s = dict(vocab=300, hidden=32, inter=64, heads=4, seq=64)
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=depth["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["heads"], max_position_embeddings=s["seq"], tie_word_embeddings=True)
    with torch.device(dev):  # random weights drawn on the device
        model = LlamaForCausalLM(cfg)
    checkpointing(model)
    micro, seq = 2, s["seq"]

    def batch(gen):
        return (rand_ids(micro, seq, s["vocab"], gen),)

    def loss(b):
        return model(input_ids=b[0], labels=b[0]).loss

    return Work(model, [p for p in model.parameters() if p.requires_grad], batch, loss, torch.bfloat16, 1.0, 3e-4,
                0.01, micro, micro * seq)


def seed002(depth, dev, tiny):
    """CLIP ViT-B/32 fine-tune: micro-batch 16 (the contrastive loss over each
    micro-batch of 16, the seed's plain accumulation), captions of 20 tokens,
    bf16 autocast, checkpointing of both towers (wick's addition to the
    seed), clip 1.0, AdamW 2e-5."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig
    if tiny:
        v = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_attention_heads=4)
        t = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_attention_heads=4, max_position_embeddings=77)
        proj = 32
    else:
        v = dict(image_size=224, patch_size=32, hidden_size=768, intermediate_size=3072, num_attention_heads=12)
        t = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                 max_position_embeddings=77)
        proj = 512
    eos = t["vocab_size"] - 1
    cfg = CLIPConfig(text_config=CLIPTextConfig(num_hidden_layers=depth["text_layers"], eos_token_id=eos,
                                                bos_token_id=eos - 1, **t).to_dict(),
                     vision_config=CLIPVisionConfig(num_hidden_layers=depth["layers"], **v).to_dict(),
                     projection_dim=proj)
    with torch.device(dev):
        model = CLIPModel(cfg)
    checkpointing(model)
    micro, n_text, size = 16, 20, v["image_size"]

    def batch(gen):
        ids = rand_ids(micro, n_text, t["vocab_size"] - 1, gen)
        ids[:, -1] = eos
        pixels = torch.randn(micro, 3, size, size, generator=gen)
        return ids, pixels

    def loss(b):
        ids, pixels = b
        return model(input_ids=ids, pixel_values=pixels, return_loss=True).loss

    return Work(model, [p for p in model.parameters() if p.requires_grad], batch, loss, torch.bfloat16, 1.0, 2e-5,
                0.01, micro, micro * n_text, note="contrastive loss over each micro-batch of 16 (wick: the window's)")


def llava(tiny, depth, real_v, real_t, family, feature_layer, tie, dev):
    """A LLaVA of a CLIP vision tower and a LLaMA or Qwen2 decoder at `depth`;
    the image token: the vocabulary's last."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config
    if tiny:
        real_v = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_attention_heads=4)
        real_t = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2)
    v = CLIPVisionConfig(num_hidden_layers=depth["vision_layers"], **real_v)
    T = Qwen2Config if family == "qwen2" else LlamaConfig
    t = T(num_hidden_layers=depth["layers"], tie_word_embeddings=tie, max_position_embeddings=4096, **real_t)
    image_token = t.vocab_size - 1
    cfg = LlavaConfig(vision_config=v, text_config=t, image_token_id=image_token, vision_feature_layer=feature_layer,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=tie)
    with torch.device(dev):
        model = LlavaForConditionalGeneration(cfg)
    visual = (real_v["image_size"] // real_v["patch_size"]) ** 2
    return model, image_token, visual, real_v["image_size"], t.vocab_size


def llava_batch(micro, visual, n_text, size, vocab, image_token, prompt, dev, dtype):
    """LLaVA's processor's output: the image token widened to the visual
    tokens, then the prompt and the caption; labels on the caption only."""
    def batch(gen):
        text = rand_ids(micro, n_text, vocab, gen, avoid=(image_token,))
        ids = torch.cat([torch.full((micro, visual), image_token), text], 1)
        labels = ids.clone()
        labels[:, :visual + prompt] = -100
        pixels = torch.randn(micro, 3, size, size, generator=gen).to(dtype)
        return ids, labels, pixels
    return batch


def seed000(depth, dev, tiny):
    """MicroVLM-V: ViT-B/16 at 224 (196 visual tokens, a CLIP-style tower of
    ViT-B/16's sizes, frozen) and Qwen2.5-0.5B (151,936-token vocabulary, tied)
    with an MLP projector; bf16 weights (bf16-true), checkpointing, micro-batch
    8 of 196 + 17 tokens, clip 1.0, AdamW 1e-4 (torch's: bf16 moments; the
    recipe's 8-bit AdamW needs bitsandbytes; with it, bitsandbytes' AdamW8bit)."""
    v = dict(image_size=224, patch_size=16, hidden_size=768, intermediate_size=3072, num_attention_heads=12)
    t = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)
    model, image_token, visual, size, vocab = llava(tiny, depth, v, t, "qwen2", -1, True, dev)
    model = model.to(device=dev, dtype=torch.bfloat16)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)
    checkpointing(model)
    micro, n_text = 8, 17  # the caption and end of text (the image token: the visual tokens)
    batch = llava_batch(micro, visual, n_text, size, vocab, image_token, 0, dev, torch.bfloat16)

    def loss(b):
        ids, labels, pixels = b
        return model(input_ids=ids, labels=labels, pixel_values=pixels).loss

    bnb = has_bnb()
    return Work(model, [p for p in model.parameters() if p.requires_grad], batch, loss, None, 1.0, 1e-4, 0.01, micro,
                micro * (visual + n_text), optim="adamw8bit" if bnb else "adamw",
                note="" if bnb else "torch's AdamW, bf16 moments (the recipe's 8-bit AdamW needs bitsandbytes)")


def seed003(depth, dev, tiny):
    """LLaVA-1.5-7B: CLIP ViT-L/14-336 (576 visual tokens, frozen) and
    LLaMA-2-7B, projector frozen, LoRA rank 8 (alpha 16, dropout 0.05) on the
    language model's linear layers, micro-batch 1 of 576 + 467 tokens (a
    466-token prompt, the caption's 17 labelled), bf16 autocast,
    checkpointing. With bitsandbytes: the seed's 4-bit NF4 weights (every
    linear layer but the head, the tower's too, as load_in_4bit does) and
    8-bit AdamW (variant qlora); without it the frozen weights stay bf16 and
    torch's AdamW steps the adapters (variant bf16-lora)."""
    from peft import LoraConfig, get_peft_model
    v = dict(image_size=336, patch_size=14, hidden_size=1024, intermediate_size=4096, num_attention_heads=16)
    t = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
             num_key_value_heads=32)
    model, image_token, visual, size, vocab = llava(tiny, depth, v, t, "llama", -2, False, dev)
    model = model.to(device=dev, dtype=torch.bfloat16)
    variant, note = "bf16-lora", "frozen weights in bf16, torch's AdamW (4-bit NF4 and 8-bit AdamW need bitsandbytes)"
    if has_bnb():
        try:
            model = quantized_4bit(model, dev)
            variant, note = "qlora", ""
        except Exception as e:  # said, and the bf16 stand-in measured instead
            note = f"4-bit NF4 failed ({type(e).__name__}: {str(e)[:200]}): frozen weights in bf16"
            say(f"  seed 003: {note}")
            gc.collect()
    for p in model.parameters():
        p.requires_grad_(False)
    checkpointing(model)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=LORA_LM))
    micro, n_text, prompt = 1, 467, 450
    batch = llava_batch(micro, visual, n_text, size, vocab, image_token, prompt, dev, torch.bfloat16)

    def loss(b):
        ids, labels, pixels = b
        return model(input_ids=ids, labels=labels, pixel_values=pixels).loss

    return Work(model, [p for p in model.parameters() if p.requires_grad], batch, loss, torch.bfloat16, 0.0, 2e-4, 0.0,
                micro, micro * (visual + n_text), note=note, variant=variant,
                optim="adamw8bit" if variant == "qlora" else "adamw")


class VideoLLM(nn.Module):
    """A video LLM as its users write one: a frozen CLIP vision tower over the
    clip's frames (20 at a time, under no_grad), each frame's patch grid
    average-pooled to 4 x 4 tokens, an MLP projector, a LLaMA decoder fed
    inputs_embeds (visual tokens, then the caption)."""

    def __init__(self, vcfg, tcfg, frame_tokens, frame_chunk, feature_layer):
        super().__init__()
        from transformers import CLIPVisionModel, LlamaForCausalLM
        self.vision_tower = CLIPVisionModel(vcfg)
        self.multi_modal_projector = nn.Sequential(nn.Linear(vcfg.hidden_size, tcfg.hidden_size), nn.GELU(),
                                                   nn.Linear(tcfg.hidden_size, tcfg.hidden_size))
        self.language_model = LlamaForCausalLM(tcfg)
        self.grid = int(math.isqrt(frame_tokens))
        self.chunk, self.layer = frame_chunk, feature_layer

    def forward(self, video, ids, labels):
        B, T = video.shape[:2]
        frames = video.flatten(0, 1)
        feats = []
        with torch.no_grad():
            for c in frames.split(self.chunk):
                h = self.vision_tower(pixel_values=c, output_hidden_states=True).hidden_states[self.layer][:, 1:]
                g = int(math.isqrt(h.shape[1]))
                h = h.transpose(1, 2).reshape(h.shape[0], h.shape[2], g, g)
                h = F.adaptive_avg_pool2d(h, self.grid).flatten(2).transpose(1, 2)
                feats.append(h)
        v = torch.cat(feats).reshape(B, T * self.grid * self.grid, -1)
        v = self.multi_modal_projector(v)
        x = torch.cat([v, self.language_model.get_input_embeddings()(ids)], 1)
        full = torch.cat([torch.full((B, v.shape[1]), -100, device=labels.device, dtype=labels.dtype), labels], 1)
        return self.language_model(inputs_embeds=x, labels=full).loss


def seed001(depth, dev, tiny):
    """Video LLM: CLIP ViT-L/14 at 224 (frozen, 20 frames at a time), 100
    frames a clip pooled to 16 tokens each (1,600 visual tokens), a 1.9 B
    LLaMA-style decoder (hidden 2048, 24 layers, vocab 92,544, untied); bf16
    weights, bf16 autocast, LoRA rank 16 (alpha 32, dropout 0.05) on the
    decoder's linear layers, the projector trained in full, checkpointing,
    micro-batch 4, clip 1.0, AdamW 2e-4. wick's offload_activations has no
    counterpart here."""
    from peft import LoraConfig, get_peft_model
    from transformers import CLIPVisionConfig, LlamaConfig
    if tiny:
        v = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_attention_heads=4)
        t = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        frames, chunk = 8, 4
    else:
        v = dict(image_size=224, patch_size=14, hidden_size=1024, intermediate_size=4096, num_attention_heads=16)
        t = dict(vocab_size=92544, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                 num_key_value_heads=8)
        frames, chunk = 100, 20
    vcfg = CLIPVisionConfig(num_hidden_layers=depth["vision_layers"], **v)
    tcfg = LlamaConfig(num_hidden_layers=depth["layers"], tie_word_embeddings=False, max_position_embeddings=4096, **t)
    with torch.device(dev):
        model = VideoLLM(vcfg, tcfg, 16 if not tiny else 4, chunk, -2).to(dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    checkpointing(model.language_model)
    model.language_model = get_peft_model(model.language_model,
                                          LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
    for p in model.multi_modal_projector.parameters():
        p.requires_grad_(True)
    micro, n_text, size = 4, 29, v["image_size"]
    visual = frames * (16 if not tiny else 4)

    def batch(gen):
        video = torch.randn(micro, frames, 3, size, size, generator=gen).to(torch.bfloat16)
        ids = rand_ids(micro, n_text, t["vocab_size"], gen)
        return video, ids, ids.clone()

    def loss(b):
        return model(*b)

    return Work(model, [p for p in model.parameters() if p.requires_grad], batch, loss, torch.bfloat16, 1.0, 2e-4, 0.0,
                micro, micro * (visual + n_text))


SEEDS = {
    "004": dict(title="34 M decoder LM from scratch, batch 2 x 512", build=seed004, towers={"layers": 8},
                goal=0.63 * GiB, card=12 * GiB, fb=True),
    "002": dict(title="CLIP ViT-B/32 fine-tune, micro-batch 16", build=seed002,
                towers={"layers": 12, "text_layers": 12}, goal=3 * GiB, card=12 * GiB),
    "000": dict(title="MicroVLM-V: ViT-B/16 + Qwen2.5-0.5B", build=seed000, towers={"layers": 24, "vision_layers": 12},
                goal=4 * GiB, card=12 * GiB),
    "001": dict(title="video LLM: CLIP ViT-L/14 + 1.9 B decoder, 100 frames, LoRA 16", build=seed001,
                towers={"layers": 24, "vision_layers": 24}, goal=6 * GiB, card=12 * GiB),
    "003": dict(title="LLaVA-1.5-7B QLoRA rank 8 (4-bit NF4 with bitsandbytes, else bf16)", build=seed003,
                towers={"layers": 32, "vision_layers": 24}, goal=4.2 * GiB, card=8 * GiB),
}
KEYS = ("peak", "reserved", "device", "sps")


def empty(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def measure(spec, depth, dev, tiny, steps, optim="adamw", profile=None):
    """One run: `steps` optimizer steps of 2 micro-batches with the towers at `depth`."""
    empty(dev)
    torch.manual_seed(1)
    cuda = dev.type == "cuda"
    build = spec["build"]
    # made on the device (random weights drawn there), then the allocator's
    # leftovers of the making (an fp32 model cast to bf16) given back
    w = build(depth, dev, tiny, optim) if optim != "adamw" else build(depth, dev, tiny)
    empty(dev)
    if optim == "sgd":
        opt = torch.optim.SGD(w.params, lr=1e-3)
    elif w.optim == "adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(w.params, lr=w.lr, weight_decay=w.wd)
    else:
        opt = torch.optim.AdamW(w.params, lr=w.lr, weight_decay=w.wd)
    gen = torch.Generator().manual_seed(1)
    # the micro-batches made on the host beforehand; each copied to the device when its turn comes (as a loader does)
    windows = [[w.batch(gen) for _ in range(2)] for _ in range(steps)]
    params = sum(p.numel() for p in w.model.parameters())
    trainable = sum(p.numel() for p in w.params)
    w.model.train()

    def step(window):
        for host in window:
            b = tuple(x.to(dev, non_blocking=True) for x in host)
            if w.autocast is not None:
                with torch.autocast(device_type=dev.type, dtype=w.autocast):
                    loss = w.loss(b)
            else:
                loss = w.loss(b)
            (loss / len(window)).backward()
        if w.clip > 0:
            torch.nn.utils.clip_grad_norm_(w.params, w.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    step(windows[0])  # warm-up: kernels chosen, optimizer state made
    if cuda:
        torch.cuda.synchronize(dev)
    # each step timed to its end on the device (as wick's are: it reads every
    # step's numbers back), the median of them the step's time
    times = []
    prof = None
    if profile is not None:  # the steps after the warm-up under torch.profiler (profile: the trace's path)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    for window in windows[1:]:
        t0 = time.perf_counter()
        step(window)
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    sps = statistics.median(times) if times else 0.0
    if prof is not None:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(profile)
    row = dict(sps=sps, params=params, trainable=trainable, peak=0, reserved=0, device=0,
               samples=2 * w.samples, tokens=2 * w.tokens, note=w.note, variant=w.variant,
               optim=type(opt).__module__.split(".")[0] + "." + type(opt).__name__, profile=prof)
    if cuda:
        row["peak"] = torch.cuda.max_memory_allocated(dev)
        row["reserved"] = torch.cuda.max_memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        row["device"] = total - free - torch.cuda.memory_reserved(dev) + row["reserved"]
    del w, opt, windows
    empty(dev)
    return row


def profiled(name, spec, depth, dev, tiny, steps, folder, suffix=""):
    """PROFILE lines: a run at `depth` with its steps after the first under torch.profiler, the time per
    step of the 15 costliest operators (device time on CUDA, host self time on the CPU), as bench/seeds.lua
    prints wick's."""
    import os
    os.makedirs(folder, exist_ok=True)
    trace = os.path.join(folder, f"python-{name}{suffix}.json")
    r = measure(spec, depth, dev, tiny, steps, profile=trace)
    print_profile(name + suffix, tag(spec["towers"], depth), r["profile"], steps - 1, r["sps"], dev.type == "cuda", trace, say)


def gib(x):
    return f"{x / GiB:9.3f}" if x > 0 else f"{'n/a':>9}"


def show(label, r):
    say(f"  {label:<34} {gib(r['peak'])} {gib(r['reserved'])} {gib(r['device'])} {r['sps']:9.4f}")


def b(x):
    return str(int(round(x))) if x > 0 else "n/a"


def tag(towers, depth):
    return "depth=" + ",".join(f"{k}={depth[k]}" for k in towers)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", default="004,002,000,001,003")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--full", default="")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps a run, the first a warm-up (cuda: 5, cpu: 3)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--no-bnb", action="store_true", help="torch's ways even where bitsandbytes is importable")
    p.add_argument("--profile", metavar="DIR", help="one more run of each seed at k layers, its steps after the "
                   "first under torch.profiler: the trace in DIR/python-NNN.json, where a step's time went printed")
    p.add_argument("--profile-only", action="store_true", help="the profiled run alone (needs --profile)")
    p.add_argument("--profile-full", action="store_true", help="the profiled run at full depth, not at k layers (its "
                   "trace DIR/python-NNNfull.json; needs --profile)")
    a = p.parse_args()
    if (a.profile_only or a.profile_full) and not a.profile:
        p.error(f"--profile-{'only' if a.profile_only else 'full'} needs --profile DIR, the folder for the traces")
    global NO_BNB
    NO_BNB = a.no_bnb
    names = [f"{int(s):03d}" if s.strip().isdigit() else s.strip() for s in a.seeds.split(",") if s.strip()]
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        say(f"seeds_peers: --device {a.device}: torch sees no CUDA device")
        for s in names:
            say(f'RESULT seed={s} side=python error="no CUDA device"')
        return 1
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    steps, K = max(2, a.steps if a.steps is not None else (5 if a.device.startswith("cuda") else 3)), a.k
    full = {f"{int(s):03d}" if s.strip().isdigit() else s.strip() for s in a.full.split(",") if s.strip()}
    import peft
    import transformers
    say(f"seeds_peers on {dev}{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}: "
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
        f"{', tiny widths (a test, not a measure)' if a.tiny else ''}; bitsandbytes "
        f"{'used (4-bit NF4, 8-bit AdamW where the seed has them)' if has_bnb() else 'absent or off'}")
    say(f"each run: {steps} optimizer steps of 2 micro-batches (the first a warm-up); towers at {K} and {2 * K} layers, "
        f"extrapolated per layer")
    results = []
    for name in names:
        spec = SEEDS.get(name)
        if spec is None:
            say(f'RESULT seed={name} side=python error="no seed {name} (expected 000 to 004)"')
            continue
        towers = spec["towers"]
        try:
            say(f"seed {name}: {spec['title']}")
            say(f"  {'bytes in GiB':<34} {'peak':>9} {'reserved':>9} {'device':>9} {'s/step':>9}")
            base_depth = {k: K for k in towers}
            prof_depth, prof_suffix = (dict(towers), "full") if a.profile_full else (base_depth, "")
            if a.profile_only:
                profiled(name, spec, prof_depth, dev, a.tiny, steps, a.profile, prof_suffix)
                continue
            base = measure(spec, base_depth, dev, a.tiny, steps)
            show(tag(towers, base_depth), base)
            say(f"MEASURE seed={name} side=python {tag(towers, base_depth)} peak={b(base['peak'])} "
                f"reserved={b(base['reserved'])} device={b(base['device'])} sps={base['sps']:.6f} params={base['params']}")
            est = {k: base[k] for k in KEYS}
            for key, real in towers.items():
                d = dict(base_depth)
                d[key] = 2 * K
                r = measure(spec, d, dev, a.tiny, steps)
                show(tag(towers, d), r)
                say(f"MEASURE seed={name} side=python {tag(towers, d)} peak={b(r['peak'])} reserved={b(r['reserved'])} "
                    f"device={b(r['device'])} sps={r['sps']:.6f} params={r['params']}")
                for k in KEYS:
                    est[k] += (real - K) / K * (r[k] - base[k])
            show(tag(towers, towers) + " (extrap.)", est)
            how, final = "extrapolated", est
            if name in full:
                m = measure(spec, dict(towers), dev, a.tiny, steps)
                show(tag(towers, towers) + " measured", m)
                say(f"MEASURE seed={name} side=python {tag(towers, towers)} peak={b(m['peak'])} "
                    f"reserved={b(m['reserved'])} device={b(m['device'])} sps={m['sps']:.6f} params={m['params']}")
                how, final = "measured", {k: m[k] for k in KEYS}
            say(f"  optimizer: {base['optim']}" + (f"; note: {base['note']}" if base["note"] else ""))
            if a.profile:
                profiled(name, spec, prof_depth, dev, a.tiny, steps, a.profile, prof_suffix)
            results.append((name, spec, how, final, base))
            emit(*results[-1], dev)
            if base.get("variant") == "bf16-lora":
                why = base["note"].replace('"', "'")
                say(f'RESULT seed={name} side=python variant=qlora n/a reason="{why}"')
            if spec.get("fb"):
                # the seed's own measurement: forward and backward at full depth; plain SGD keeps no state
                fb = measure(spec, dict(towers), dev, a.tiny, steps, optim="sgd")
                show("forward + backward (sgd)", fb)
                results.append((name + "fb", spec, "measured", {k: fb[k] for k in KEYS}, fb))
                emit(*results[-1], dev)
        except Exception as e:  # one seed's failure: said, and the next seed runs
            msg = f"{type(e).__name__}: {e}".replace('"', "'").replace("\n", " ")[:400]
            say(f"seed {name}: error: {msg}")
            traceback.print_exc(file=sys.stderr)
            results.append((name, spec, "error", msg, None))
            emit(*results[-1], dev)
        # out of the except block: the traceback's frames (and their tensors) are gone
        empty(dev)
    say("")
    say(f"{'seed':<6} {'peak alloc':>10} {'reserved':>10} {'device':>10} {'s/step':>9} {'samples/s':>10} {'goal GiB':>8} "
        f"{'fits':<4} {'card':>4} {'fits':<4} how")
    for name, spec, how, final, base in results:
        if how == "error":
            say(f"{name:<6} error: {final}")
            continue
        on_card = final["device"] or final["reserved"] or final["peak"]
        fits_goal = ("yes" if final["peak"] <= spec["goal"] else "NO") if final["peak"] > 0 else "n/a"
        fits_card = ("yes" if on_card <= spec["card"] else "NO") if on_card > 0 else "n/a"
        say(f"{name:<6} {gib(final['peak']):>10} {gib(final['reserved']):>10} {gib(final['device']):>10} "
            f"{final['sps']:9.4f} {base['samples'] / max(final['sps'], 1e-9):10.2f} {spec['goal'] / GiB:8.2f} "
            f"{fits_goal:<4} {spec['card'] / GiB:4.0f} {fits_card:<4} {how}"
            f"{' (' + base['variant'] + ')' if base.get('variant') else ''}")
    say("GiB; peak alloc: torch.cuda.max_memory_allocated over the steps; reserved: max_memory_reserved; device: the")
    say("process's device memory, context included; samples/s: 2 micro-batches a step. fits: peak against the goal,")
    say("device against the card. (n/a and 0 on the CPU, where torch counts no bytes.)")
    return 0


def emit(name, spec, how, final, base, dev):
    if how == "error":
        say(f'RESULT seed={name} side=python error="{final}"')
        return
    sps = max(final["sps"], 1e-9)
    on_card = final["device"] or final["reserved"] or final["peak"]
    extra = f" variant={base['variant']}" if base.get("variant") else ""
    extra += f" optim={base['optim']}" if base.get("optim") else ""
    fits_goal = ("yes" if final["peak"] <= spec["goal"] else "no") if final["peak"] > 0 else "n/a"
    fits_card = ("yes" if on_card <= spec["card"] else "no") if on_card > 0 else "n/a"
    say(f"RESULT seed={name} side=python on={dev} how={how}{extra} peak={b(final['peak'])} reserved={b(final['reserved'])} "
        f"device={b(final['device'])} sps={sps:.6f} samples_per_s={base['samples'] / sps:.3f} "
        f"tokens_per_s={base['tokens'] / sps:.1f} goal={b(spec['goal'])} card={b(spec['card'])} "
        f"fits_goal={fits_goal} fits_card={fits_card}")


if __name__ == "__main__":
    sys.exit(main())
