#!/usr/bin/env python3
"""Teacher scoring: per-token log-probs of B x L tokens through opd-teacher over gRPC, vs
transformers computing the same log-probs in-process (same random model, same inputs, same
thread count), plus the same scoring in-process in C++ to measure the gRPC overhead.
Prints tokens/s for each, the ratio ours(gRPC)/transformers (target >= 1.5x) and the overhead
of going through the service (target <= 5%)."""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import make_model  # noqa: E402  (the same model as the forward benchmark)
from service_util import new_secret, running_service  # noqa: E402


def run_bench(build, args, env=None):
    out = subprocess.check_output([os.path.join(build, "bench", "bench_serving"), *args], env=env)
    return json.loads(out.decode().strip().splitlines()[-1])


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
    ids_file = os.path.join(args.workdir, "teacher_ids.json")
    json.dump(ids.tolist(), open(ids_file, "w"))
    common = [f"--ids={ids_file}", f"--repeats={args.repeats}", "--mode=score"]

    secret = new_secret()
    tokens = args.batch * args.len
    with running_service(os.path.join(args.build, "teacher_service", "opd-teacher"),
                         [f"--model={model_dir}", f"--threads={args.threads}",
                          f"--max-batch-tokens={tokens}"], secret) as addr:
        # Both sides in one process, alternating, so that both see the same machine load.
        both = run_bench(args.build, [*common, f"--addr={addr}", f"--model={model_dir}", f"--threads={args.threads}"],
                         env=dict(os.environ, OPD_SECRET=secret))
    grpc_side, inproc = both["grpc"], both["inprocess"]

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
    scored = args.batch * (args.len - 1)
    theirs = scored / min(times)
    print(f"teacher scoring, {args.batch} x {args.len} tokens, hidden 512, 8 layers, 64 experts top-8, "
          f"vocab 151936, {args.threads} threads")
    print(f"  ours via gRPC:     {grpc_side['tokens_per_s']:9.1f} tokens/s  (checksum {grpc_side['checksum']:.4f})")
    print(f"  ours in-process:   {inproc['tokens_per_s']:9.1f} tokens/s  (checksum {inproc['checksum']:.4f})")
    print(f"  transformers:      {theirs:9.1f} tokens/s  (checksum {checksum:.4f})")
    print(f"  ratio ours(gRPC)/transformers: {grpc_side['tokens_per_s'] / theirs:.2f}x  (target >= 1.5x)")
    overhead = 1.0 - grpc_side['tokens_per_s'] / inproc['tokens_per_s']
    print(f"  gRPC overhead vs in-process: {100 * overhead:.1f}%  (target <= 5%)")


if __name__ == "__main__":
    main()
