"""The weight push to rollout workers, side by side: rank 0's star (a WeightPusher per worker: the
checksums of the whole model on one thread, then one two-rank Gloo group per worker, rank 0
sending everything to everyone) against the parallel push of every learner rank
(WeightPublisher: one Gloo group of every learner rank and every worker, each rank broadcasting
its 1/N share of the bf16 bytes).

L learner processes (bench_weight_publish) push to W opd-rollout workers (bf16) on loopback; every
parameter changes before each push (as after an optimizer step), so every tensor goes. The time
is the push on rank 0 (the workers' receipt, checks and commit included), the median over the
pushes after the first (which forms the groups). Presets: demo (the demo's student: the
latency-bound case), nano_layer (one Marco-Nano layer and its embedding, 0.43B parameters: the
bandwidth-bound case, at a size a small machine holds).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(__file__))
from service_util import new_secret, running_service  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(bench, how, ranks, workers, model, secret_file, steps, bucket_mb, threads):
    port = free_port()
    procs = [subprocess.Popen(
        [bench, "push", f"--rank={r}", f"--world={ranks}", f"--master_port={port}",
         f"--workers={','.join(workers)}", f"--model={model}", f"--secret_file={secret_file}",
         f"--how={how}", "--sync=collective", f"--steps={steps}", f"--bucket_mb={bucket_mb}",
         f"--threads={threads}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(ranks)]
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{how}: {err[-4000:]}")
    lines = [json.loads(l) for l in outs[0][0].splitlines() if l.startswith("{")]
    for l in lines:
        if not l["status"]["ok"]:
            raise RuntimeError(f"{how}: {l['status']}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--presets", default="demo,nano_layer")
    ap.add_argument("--ranks", type=int, default=2, help="learner ranks")
    ap.add_argument("--workers", type=int, default=2, help="rollout workers")
    ap.add_argument("--steps", type=int, default=4, help="pushes per run (the first forms groups)")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    bench = os.path.join(args.build, "bench/bench_weight_publish")
    secret = new_secret()
    os.makedirs(args.workdir, exist_ok=True)
    secret_file = os.path.join(args.workdir, "weight_publish_secret")
    with open(secret_file, "w") as f:
        f.write(secret + "\n")
    os.chmod(secret_file, 0o600)
    for preset in args.presets.split(","):
        model = os.path.join(args.workdir, f"weight_publish_{preset}")
        if not os.path.exists(os.path.join(model, "config.json")):
            out = subprocess.run([bench, "make-model", f"--out={model}", f"--preset={preset}"],
                                 check=True, capture_output=True, text=True).stdout
            print("made", model, out.strip())
        rollout = [f"--model={model}", "--dtype=bfloat16", f"--threads={args.threads}",
                   "--max-message-mb=64"]
        with ExitStack() as stack:
            workers = [stack.enter_context(running_service(
                os.path.join(args.build, "rollout/opd-rollout"), rollout, secret))
                for _ in range(args.workers)]
            times, gb = {}, 0
            for how in ("star", "parallel"):
                lines = run(bench, how, args.ranks, workers, model, secret_file, args.steps,
                            args.bucket_mb, args.threads)
                times[how] = statistics.median(l["seconds"] for l in lines[1:])
                gb = lines[-1]["bytes"] / 1e9
        print(f"{preset}: {args.ranks} learner ranks -> {args.workers} bf16 workers, "
              f"{gb:.3f} GB received by the workers per push; push (median of {args.steps - 1}): "
              f"rank 0 star {times['star']:.3f} s | every rank {times['parallel']:.3f} s | "
              f"star / every rank = {times['star'] / times['parallel']:.2f}x")


if __name__ == "__main__":
    main()
