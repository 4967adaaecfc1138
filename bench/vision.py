"""One row of bench/vision.sh, in Python: the video classifier (a ViT on
every frame, a temporal transformer, a linear head) and the LLaVA-style VLM
(CLIP vision tower, projector, LLaMA) built from transformers' modules with
the sizes bench/vision.lua gives wick, trained for a few AdamW steps on the
same batches; prints milliseconds per step (the median of the steps after
the first) and peak
memory (CUDA: max allocated; always: the process's peak resident set).

  python bench/vision.py data  video|vlm FILE   writes the batches (both sides read them)
  python bench/vision.py train video|vlm FILE [checkpointing]"""
import resource
import sys
import time

import torch
from safetensors.torch import load_file, save_file

# the sizes; bench/vision.lua has the same
VIDEO = dict(batch=4, frames=8, image=112, patch=16, hidden=192, inter=768, layers=4, heads=3, classes=10)
VLM = dict(batch=4, image=64, patch=8, vhidden=192, vinter=768, vlayers=4, vheads=3, text=48, vocab=258, image_token=257,
           hidden=256, inter=688, layers=4, heads=4)
STEPS = 11  # the first is not timed; the figure is the median of the rest


def write_data(kind, path):
    g = torch.Generator().manual_seed(0)
    n = STEPS * (VIDEO["batch"] if kind == "video" else VLM["batch"])
    if kind == "video":
        c = VIDEO
        save_file({"video": torch.randint(0, 256, (n, c["frames"], 3, c["image"], c["image"]), generator=g, dtype=torch.uint8),
                   "label": torch.randint(0, c["classes"], (n,), generator=g)}, path)
    else:
        c = VLM
        ids = torch.randint(0, 256, (n, c["text"]), generator=g)
        ids[:, 0] = c["image_token"]
        labels = ids.clone()
        labels[:, :8] = -100  # the image token and a prompt: no loss
        save_file({"input_ids": ids, "labels": labels,
                   "pixel_values": torch.randn(n, 3, c["image"], c["image"], generator=g)}, path)


class VideoClassifier(torch.nn.Module):
    def __init__(self, c, checkpointing):
        super().__init__()
        from transformers import ViTConfig, ViTModel
        from transformers.models.vit.modeling_vit import ViTLayer
        cfg = ViTConfig(image_size=c["image"], patch_size=c["patch"], hidden_size=c["hidden"],
                        intermediate_size=c["inter"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.vit = ViTModel(cfg, add_pooling_layer=False)
        if checkpointing:
            checkpoint(self.vit)
        self.checkpointing = checkpointing
        self.position_embeddings = torch.nn.Parameter(torch.randn(1, c["frames"], c["hidden"]) * 0.02)
        self.temporal = torch.nn.ModuleList([ViTLayer(cfg)])
        self.layernorm = torch.nn.LayerNorm(c["hidden"], eps=cfg.layer_norm_eps)
        self.classifier = torch.nn.Linear(c["hidden"], c["classes"])
        self.register_buffer("mean", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1))

    def forward(self, video):
        N, T = video.shape[:2]
        frames = (video.flatten(0, 1).float() / 255 - self.mean) / self.std
        h = self.vit(pixel_values=frames).last_hidden_state[:, 0].view(N, T, -1)
        h = h + self.position_embeddings[:, :T]
        for layer in self.temporal:
            run = lambda x, layer=layer: first(layer(x))
            h = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False) if self.checkpointing else run(h)
        return self.classifier(self.layernorm(h).mean(1))


def vlm_model(c, checkpointing):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(image_size=c["image"], patch_size=c["patch"], hidden_size=c["vhidden"],
                              intermediate_size=c["vinter"], num_hidden_layers=c["vlayers"], num_attention_heads=c["vheads"])
    text = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                       num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                       max_position_embeddings=256, tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=c["image_token"], vision_feature_layer=-2,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    m = LlavaForConditionalGeneration(cfg)
    for p in m.model.vision_tower.parameters():  # wick's freeze_vision = true
        p.requires_grad_(False)
    if checkpointing:
        checkpoint(m)
    return m


def checkpoint(model):
    # transformers 5 renamed gradient_checkpointing_enable
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def first(out):
    return out[0] if isinstance(out, tuple) else out


def widen(x, fill, V):
    # LLaVA's processor: one image token per visual token (the image token is first in every row)
    return torch.cat([torch.full((x.shape[0], V), fill, dtype=x.dtype), x[:, 1:]], dim=1)


def train(kind, path, checkpointing):
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    data = load_file(path)
    if kind == "video":
        c = VIDEO
        model = VideoClassifier(c, checkpointing).to(dev)
    else:
        c = VLM
        model = vlm_model(c, checkpointing).to(dev)
        V = (c["image"] // c["patch"]) ** 2
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    B = c["batch"]
    times = []
    for step in range(STEPS):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sl = slice(step * B, (step + 1) * B)
        opt.zero_grad()
        if kind == "video":
            logits = model(data["video"][sl].to(dev))
            loss = torch.nn.functional.cross_entropy(logits, data["label"][sl].to(dev))
        else:
            ids, labels = data["input_ids"][sl], data["labels"][sl]
            loss = model(input_ids=widen(ids, c["image_token"], V).to(dev),
                         labels=widen(labels, -100, V).to(dev),
                         pixel_values=data["pixel_values"][sl].to(dev)).loss
        loss.backward()
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = 1000 * sorted(times[1:])[(len(times) - 1) // 2]
    tensors = f"{torch.cuda.max_memory_allocated() / 2**20:.1f}" if dev == "cuda" else "n/a"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT {ms:.1f} {tensors} {rss:.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "data":
        write_data(sys.argv[2], sys.argv[3])
    else:
        train(sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "checkpointing")
