#!/usr/bin/env python3
"""bf16 teacher scoring on the CPU: opd-teacher --dtype=bfloat16 over gRPC vs transformers with the
model loaded in bf16 (same random model, same inputs, same thread count, same machine), and vs our
own fp32 path (opd-teacher --dtype=float32, whose CPU fast paths are fp32-only). Prints tokens/s
for each and the ratios, and which bf16 matrix kernel ran: the CPU's bf16 features
(/proc/cpuinfo: avx512_bf16, amx_bf16) and the oneDNN implementation that each side's bf16
matmuls dispatched to (ONEDNN_VERBOSE on a short run)."""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

import torch
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import make_model  # noqa: E402  (the forward benchmark's model)
from service_util import new_secret, running_service  # noqa: E402


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def onednn_impls(lines):
    """The implementations of oneDNN's exec lines, with how often each ran."""
    seen = collections.Counter()
    for line in lines:
        if not line.startswith("onednn_verbose") or ",exec," not in line:
            continue
        parts = line.split(",")
        # onednn_verbose,[timestamp,]exec,cpu,<primitive>,<implementation>,...
        i = parts.index("exec")
        seen[f"{parts[i + 2]}:{parts[i + 3]}"] += 1
    return seen


def describe(seen):
    return ", ".join(f"{k} x{v}" for k, v in seen.most_common(4)) or "none (oneDNN not used)"


def serve_and_score(build, model_dir, dtype, threads, tokens, ids_file, repeats, env=None):
    secret = new_secret()
    args = [f"--model={model_dir}", f"--threads={threads}", f"--dtype={dtype}",
            f"--max-batch-tokens={tokens}"]
    with running_service(os.path.join(build, "teacher_service", "opd-teacher"), args, secret) as addr:
        out = subprocess.check_output(
            [os.path.join(build, "bench", "bench_serving"), f"--ids={ids_file}", f"--repeats={repeats}",
             "--mode=score", f"--addr={addr}"], env=dict(os.environ, OPD_SECRET=secret))
    return json.loads(out.decode().strip().splitlines()[-1])["grpc"]


def our_bf16_kernels(build, model_dir, workdir):
    """Runs a bf16 teacher with ONEDNN_VERBOSE on one short request and reads its log."""
    ids_file = os.path.join(workdir, "bf16_kernel_ids.json")
    json.dump([list(range(1, 33))], open(ids_file, "w"))
    log = os.path.join(workdir, "bf16_teacher_onednn.log")
    secret = new_secret()
    env = dict(os.environ, OPD_SECRET=secret, ONEDNN_VERBOSE="1")
    proc = subprocess.Popen([os.path.join(build, "teacher_service", "opd-teacher"), f"--model={model_dir}",
                             "--dtype=bfloat16", "--threads=1", "--listen=127.0.0.1:0",
                             f"--port-file={log}.port"], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 300
        while not os.path.exists(log + ".port"):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("opd-teacher did not start:\n" + open(log).read()[-2000:])
            time.sleep(0.05)
        time.sleep(0.2)
        addr = "127.0.0.1:" + open(log + ".port").read().strip()
        subprocess.check_output([os.path.join(build, "bench", "bench_serving"), f"--ids={ids_file}",
                                 "--repeats=1", "--mode=score", f"--addr={addr}"], env=env)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.remove(log + ".port")
    return onednn_impls(open(log).read().splitlines())


def torch_bf16_kernels():
    """A bf16 linear of the LM head's shape under ONEDNN_VERBOSE, in a child python."""
    code = ("import torch; x=torch.randn(64,512,dtype=torch.bfloat16); w=torch.randn(4096,512,dtype=torch.bfloat16);"
            "torch.nn.functional.linear(x,w)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ONEDNN_VERBOSE="1"),
                         capture_output=True, text=True).stdout
    return onednn_impls(out.splitlines())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = os.path.join(args.workdir, "qwen3moe_h512_l8_e64")
    make_model(model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (args.batch, args.len), generator=g)
    ids_file = os.path.join(args.workdir, "bf16_scoring_ids.json")
    json.dump(ids.tolist(), open(ids_file, "w"))
    tokens = args.batch * args.len

    ours_bf16 = serve_and_score(args.build, model_dir, "bfloat16", args.threads, tokens, ids_file, args.repeats)
    ours_fp32 = serve_and_score(args.build, model_dir, "float32", args.threads, tokens, ids_file, args.repeats)

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
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
    theirs = args.batch * (args.len - 1) / min(times)

    flags = cpu_flags()
    has = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    print(f"bf16 teacher scoring, {args.batch} x {args.len} tokens, hidden 512, 8 layers, 64 experts top-8, "
          f"vocab 151936, {args.threads} threads")
    print(f"  CPU bf16 features: {', '.join(has) or 'none'}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"  ours bf16 (gRPC):      {ours_bf16['tokens_per_s']:9.1f} tokens/s  (checksum {ours_bf16['checksum']:.4f})")
    print(f"  transformers bf16:     {theirs:9.1f} tokens/s  (checksum {checksum:.4f})")
    print(f"  ours fp32 (gRPC):      {ours_fp32['tokens_per_s']:9.1f} tokens/s  (checksum {ours_fp32['checksum']:.4f})")
    print(f"  ratio ours bf16 / transformers bf16: {ours_bf16['tokens_per_s'] / theirs:.2f}x")
    print(f"  ratio ours bf16 / ours fp32:         {ours_bf16['tokens_per_s'] / ours_fp32['tokens_per_s']:.2f}x")
    print(f"  bf16 matmul kernels, ours (opd-teacher): {describe(our_bf16_kernels(args.build, model_dir, args.workdir))}")
    print(f"  bf16 matmul kernels, torch (python):     {describe(torch_bf16_kernels())}")


if __name__ == "__main__":
    main()
