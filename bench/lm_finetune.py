"""One row of bench/lm_finetune.sh, in Python: the same decoder as a
transformers LlamaForCausalLM, fine-tuned fully or with PEFT's LoRA on random
tokens for a few AdamW steps; prints tokens per second (steps after the first)
and peak resident memory. QLoRA needs bitsandbytes' CUDA kernels: on a CPU
this prints n/a."""
import resource
import sys
import time

import torch


def main(mode, steps=6, micro=4, seq=256):
    if mode == "qlora" and not torch.cuda.is_available():
        print("RESULT n/a n/a n/a")
        return
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens, seconds = 0, 0.0
    for step in range(steps):
        ids = torch.randint(0, 256, (micro, seq), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step > 0:
            tokens += micro * (seq - 1)
            seconds += dt
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT {tokens / seconds:.1f} n/a {rss:.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
