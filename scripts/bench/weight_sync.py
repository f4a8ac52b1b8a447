"""Weight sync: a learner pushing a 1.0B-parameter model to an opd-rollout worker (bf16, so 2.0 GB
on the wire), over gRPC streaming vs collective sync (c10d Gloo), on loopback.

The model is one decoder layer of Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads of 128, vocab
151936 untied) with 76 experts of 768: 1.0B parameters of real tensor shapes, small enough for a
24 GiB machine (the worker holds the serving and the staged copy, the learner its fp32 weights).
Each push changes every parameter first (as an optimizer step does), so every tensor is sent;
the time is the learner's Push (the worker's staging, receiving, checks and the swap included),
plus, reported apart, the learner's checksum pass. Rounds alternate between the two paths.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from service_util import new_secret, running_service  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--experts", type=int, default=76)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="pushes per round and path")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bench = os.path.join(args.build, "bench/bench_weight_sync")
    model = os.path.join(args.workdir, f"weight_sync_1b_e{args.experts}")
    if not os.path.exists(os.path.join(model, "config.json")) or not any(
            f.endswith(".safetensors") for f in os.listdir(model)):
        out = subprocess.run([bench, "make-model", f"--out={model}", f"--experts={args.experts}"],
                             check=True, capture_output=True, text=True).stdout
        print("made", model, out.strip())
    secret = new_secret()
    secret_file = os.path.join(args.workdir, "weight_sync_secret")
    with open(secret_file, "w") as f:
        f.write(secret + "\n")
    os.chmod(secret_file, 0o600)
    results = {"grpc": [], "collective": []}
    rollout = [f"--model={model}", "--dtype=bfloat16", f"--threads={args.threads}",
               "--max-message-mb=64"]
    with running_service(os.path.join(args.build, "rollout/opd-rollout"), rollout, secret) as addr:
        for _ in range(args.rounds):
            for sync in ("grpc", "collective"):
                p = subprocess.run(
                    [bench, "push", f"--addr={addr}", f"--secret_file={secret_file}",
                     f"--model={model}", f"--sync={sync}", f"--repeat={args.repeat}",
                     f"--bucket_mb={args.bucket_mb}", f"--threads={args.threads}"],
                    capture_output=True, text=True)
                if p.returncode != 0:
                    raise RuntimeError(p.stderr[-4000:])
                for line in p.stdout.splitlines():
                    if line.startswith("{"):
                        r = json.loads(line)
                        assert r["collective"] == (sync == "collective"), r
                        results[sync].append(r)
    summary = {}
    for sync, rs in results.items():
        push = statistics.median(r["push_s"] for r in rs)
        gb = rs[0]["bytes"] / 1e9
        summary[sync] = push
        print(f"{sync:>10}: {rs[0]['tensors']} tensors, {gb:.2f} GB bf16, push {push:.2f} s "
              f"(median of {len(rs)}), {gb / push:.2f} GB/s; checksums "
              f"{statistics.median(r['checksum_s'] for r in rs):.2f} s; "
              f"connect {statistics.median(r['connect_s'] for r in rs):.2f} s")
    print(f"collective sync over Gloo is {summary['grpc'] / summary['collective']:.2f}x "
          f"gRPC streaming (push time ratio grpc/collective)")


if __name__ == "__main__":
    main()
