#!/usr/bin/env python3
"""The rollout engine on a long-tailed workload: 64 prompts x 2 samples, each prompt with its own
output length (log-normal, median ~27 tokens, a tail 10-15x longer), no stop ids, sampling at
temperature 1. In one run, each in its own process (so that peak memory is its own):
  ours, engine       the paged engine, all requests at once (continuous batching);
  ours, static each  the static sampler, one request (prompt x 2) after another;
  ours, static one   the static sampler, all prompts in one request run to the longest length;
  hf each / hf one   transformers' generate the same two ways (one prompt per call; or all
                     prompts left-padded in one call, max_new_tokens = the longest).
Generated tokens count each sequence's own length only. Prints tokens/s, peak RSS, the KV cache
needed, and the engine's ratios."""
import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB = 32000


def make_model(path, seed=0):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=32,
                         num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                         tie_word_embeddings=False, max_position_embeddings=4096)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def workload(n, seed=1):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(16, 64)
        new = int(min(400, max(4, math.exp(rng.gauss(3.3, 1.0)))))
        reqs.append({"prompt": [rng.randrange(VOCAB) for _ in range(plen)], "max_new": new})
    return reqs


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def hf_child(model_dir, reqs_file, mode, threads, samples):
    torch.set_num_threads(threads)
    reqs = json.load(open(reqs_file))
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def gen(prompts, max_new):
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                              num_return_sequences=samples, max_new_tokens=max_new,
                              min_new_tokens=max_new, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=0)

    with torch.no_grad():
        gen([reqs[0]["prompt"]], 4)  # warm-up
        torch.manual_seed(0)
        t0 = time.perf_counter()
        if mode == "hf_each":
            for r in reqs:
                gen([r["prompt"]], r["max_new"])
        else:
            gen([r["prompt"] for r in reqs], max(r["max_new"] for r in reqs))
        secs = time.perf_counter() - t0
    tokens = samples * sum(r["max_new"] for r in reqs)
    print(json.dumps({"mode": mode, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                      "peak_rss_mib": peak_rss_mib(), "kv_mib": float("nan")}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-child", nargs=2, metavar=("MODE", "REQUESTS"))
    args = ap.parse_args()
    model_dir = os.path.join(args.workdir, "qwen3moe_h256_l4_e32_v32k")
    if args.hf_child:
        return hf_child(model_dir, args.hf_child[1], args.hf_child[0], args.threads, args.samples)
    os.makedirs(args.workdir, exist_ok=True)
    make_model(model_dir)
    reqs = workload(args.prompts)
    reqs_file = os.path.join(args.workdir, "rollout_engine_requests.json")
    json.dump(reqs, open(reqs_file, "w"))
    lens = sorted(r["max_new"] for r in reqs)
    print(f"rollout engine, {args.prompts} prompts (16-64 tokens) x {args.samples} samples, output lengths "
          f"log-normal: median {lens[len(lens) // 2]}, max {lens[-1]}, total {args.samples * sum(lens)} tokens; "
          f"hidden 256, 4 layers, 32 experts top-4, vocab {VOCAB}, fp32, {args.threads} threads")
    results = {}
    for mode in ["engine", "static_each", "static_one"]:
        out = subprocess.check_output([
            os.path.join(args.build, "bench", "bench_rollout_engine"), f"--model={model_dir}",
            f"--requests={reqs_file}", f"--mode={mode}", f"--threads={args.threads}",
            f"--samples={args.samples}", "--kv_cache_gb=1"])
        results[mode] = json.loads(out.decode().strip().splitlines()[-1])
    for mode in ["hf_each", "hf_one"]:
        out = subprocess.check_output([sys.executable, os.path.abspath(__file__), f"--workdir={args.workdir}",
                                       f"--threads={args.threads}", f"--samples={args.samples}",
                                       "--hf-child", mode, reqs_file])
        results[mode] = json.loads(out.decode().strip().splitlines()[-1])
    names = {"engine": "ours, paged engine", "static_each": "ours, static per request",
             "static_one": "ours, static one batch", "hf_each": "transformers per request",
             "hf_one": "transformers one batch"}
    for mode, r in results.items():
        kv = "" if math.isnan(r["kv_mib"]) else f", KV cache {r['kv_mib']:.1f} MiB"
        print(f"  {names[mode]:26s} {r['tokens_per_s']:8.1f} tokens/s  peak RSS {r['peak_rss_mib']:7.0f} MiB{kv}")
    e = results["engine"]
    print(f"  engine: mean running sequences per decode step {e['mean_running']:.1f}, "
          f"{e['decode_steps']} decode steps, {e['preemptions']} preemptions, pool {e['pool_mib']:.0f} MiB (untouched pages cost nothing)")
    for mode in ["static_each", "static_one", "hf_each", "hf_one"]:
        print(f"  ratio engine / {names[mode]}: {e['tokens_per_s'] / results[mode]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
