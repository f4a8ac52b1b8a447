#!/usr/bin/env python3
"""Rollout sampling from a Qwen3-Next student (recurrent-state caching: conv windows and delta-rule
states per sequence, keys/values of the full-attention layers): P prompts x 2 samples x N new
tokens through opd-rollout over gRPC (the paged engine) and through the static sampler in-process,
vs transformers' generate(do_sample=True, num_return_sequences=2) with its own cache (its PyTorch
fallbacks: causal_conv1d_update and the per-token recurrent delta rule). Same random model as the
Qwen3-Next scoring benchmark (scripts/bench/qwen3_next.py), same prompts, same thread count, plain
sampling at temperature 1, no early stop. Prints generated tokens/s and the ratios."""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
from transformers import Qwen3NextForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen3_next import make_model  # noqa: E402  (the scoring benchmark's model)
from service_util import new_secret, running_service  # noqa: E402


def run_bench(build, args, env=None):
    out = subprocess.check_output([os.path.join(build, "bench", "bench_serving"), *args], env=env)
    return json.loads(out.decode().strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = os.path.join(args.workdir, f"qwen3next_h512_l8_e64_v{args.vocab}")
    make_model(model_dir, args.vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g)
    ids_file = os.path.join(args.workdir, "qwen3_next_rollout_prompts.json")
    json.dump(ids.tolist(), open(ids_file, "w"))
    common = [f"--ids={ids_file}", f"--repeats={args.repeats}", "--mode=generate",
              f"--samples={args.samples}", f"--max-new-tokens={args.new_tokens}", "--seed=0"]

    secret = new_secret()
    with running_service(os.path.join(args.build, "rollout", "opd-rollout"),
                         [f"--model={model_dir}", f"--threads={args.threads}"], secret) as addr:
        both = run_bench(args.build, [*common, f"--addr={addr}", f"--model={model_dir}",
                                      f"--threads={args.threads}"],
                         env=dict(os.environ, OPD_SECRET=secret))
    grpc_side, inproc = both["grpc"], both["inprocess"]

    model = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = torch.ones_like(ids)
    times, generated = [], 0
    with torch.no_grad():
        for r in range(args.repeats + 1):
            torch.manual_seed(r)
            n = 4 if r == 0 else args.new_tokens  # a short warm-up
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 num_return_sequences=args.samples, max_new_tokens=n, min_new_tokens=n,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
            if r > 0:
                times.append(time.perf_counter() - t0)
                generated = (out.shape[1] - args.prompt_len) * out.shape[0]
    theirs = generated / min(times)
    print(f"Qwen3-Next rollout sampling, {args.prompts} prompts x {args.samples} samples x "
          f"{args.new_tokens} new tokens (prompt {args.prompt_len}), hidden 512, 8 layers (6 linear), "
          f"64 experts top-8, vocab {args.vocab}, {args.threads} threads")
    print(f"  ours via gRPC (paged engine): {grpc_side['tokens_per_s']:9.1f} tokens/s")
    print(f"  ours in-process (static):     {inproc['tokens_per_s']:9.1f} tokens/s")
    print(f"  transformers generate:        {theirs:9.1f} tokens/s")
    print(f"  ratio ours(gRPC)/transformers: {grpc_side['tokens_per_s'] / theirs:.2f}x")


if __name__ == "__main__":
    main()
