#!/usr/bin/env python3
"""Per-token log-probs of B x L tokens: our C++ forward vs transformers' forward, same random
model, same inputs, same thread count, in one run. Prints tokens/s for both and the ratio."""
import argparse
import json
import os
import subprocess
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def make_model(path, seed=0):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64,
                         num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                         tie_word_embeddings=False, max_position_embeddings=4096)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = os.path.join(args.workdir, "qwen3moe_h512_l8_e64")
    make_model(model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (args.batch, args.len), generator=g)
    ids_file = os.path.join(args.workdir, "forward_ids.json")
    json.dump(ids.tolist(), open(ids_file, "w"))

    ours = json.loads(subprocess.check_output([
        os.path.join(args.build, "bench", "bench_forward"), f"--model={model_dir}", f"--ids={ids_file}",
        f"--threads={args.threads}", f"--repeats={args.repeats}"]).decode().strip().splitlines()[-1])

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    times, checksum = [], 0.0
    with torch.no_grad():
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            logits = model(input_ids=ids).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            checksum = lp.sum().item()
            if r > 0:
                times.append(time.perf_counter() - t0)
            del logits, lp
    theirs = ids.numel() / min(times)
    print(f"forward log-probs, {args.batch} x {args.len} tokens, hidden 512, 8 layers, 64 experts top-8, "
          f"vocab 151936, {args.threads} threads")
    print(f"  ours (C++):       {ours['tokens_per_s']:9.1f} tokens/s  (checksum {ours['checksum']:.4f})")
    print(f"  transformers:     {theirs:9.1f} tokens/s  (checksum {checksum:.4f})")
    print(f"  ratio ours/theirs: {ours['tokens_per_s'] / theirs:.2f}x")


if __name__ == "__main__":
    main()
