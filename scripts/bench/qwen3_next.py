#!/usr/bin/env python3
"""Scoring (per-token log-probs of one packed prefill) on a mid-size random Qwen3-Next: our C++
forward vs transformers' forward (its PyTorch fallbacks: a Python loop over 64-token chunks for the
delta rule), same model, same input, same thread count, in one run. Prints tokens/s for both and
the ratio.

The model keeps Qwen3-Next-80B's proportions at hidden 512: 8 layers (6 Gated DeltaNet, 2 gated
attention), 4 key / 8 value linear heads of dim 128, 8 / 2 attention heads of dim 128 with partial
rotary 0.25, 64 experts top-8 of width 256 plus a shared expert of 256, the full 151,936 vocabulary
(--vocab changes it: at this hidden size the LM head is over half of all FLOPs, the same matmul on
both sides, so a small vocabulary shows the model body's ratio).
"""
import argparse
import json
import os
import subprocess
import time

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

def make_model(path, vocab, seed=0):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=512, num_hidden_layers=8, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.25,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, intermediate_size=1024, norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=4096)
    Qwen3NextForCausalLM(cfg).save_pretrained(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = os.path.join(args.workdir, f"qwen3next_h512_l8_e64_v{args.vocab}")
    make_model(model_dir, args.vocab)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.len), generator=g)
    ids_file = os.path.join(args.workdir, "qwen3_next_ids.json")
    with open(ids_file, "w") as f:
        json.dump(ids.tolist(), f)

    ours = json.loads(subprocess.check_output([
        os.path.join(args.build, "bench", "bench_forward"), f"--model={model_dir}", f"--ids={ids_file}",
        f"--threads={args.threads}", f"--repeats={args.repeats}"]).decode().strip().splitlines()[-1])

    model = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    times, checksum = [], 0.0
    with torch.no_grad():
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            checksum = lp.sum().item()
            if r > 0:  # the first run warms caches and allocators
                times.append(time.perf_counter() - t0)
            del logits, lp
    theirs = ids.numel() / min(times)
    print(f"Qwen3-Next scoring, {args.batch} x {args.len} tokens, hidden 512, 8 layers (6 linear, 2 full), "
          f"64 experts top-8 + shared, vocab {args.vocab}, {args.threads} threads")
    print(f"  ours (C++):       {ours['tokens_per_s']:9.1f} tokens/s  (checksum {ours['checksum']:.4f})")
    print(f"  transformers:     {theirs:9.1f} tokens/s  (checksum {checksum:.4f})")
    print(f"  ratio ours/theirs: {ours['tokens_per_s'] / theirs:.2f}x")


if __name__ == "__main__":
    main()
