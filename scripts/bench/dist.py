#!/usr/bin/env python3
"""The learner's collectives: our process group (bench_dist: lm::dist over c10d Gloo) next to
torch.distributed driven from Python (the same c10d library; the reference any PyTorch learner
uses), N processes on loopback each, same sizes, same repetitions, in one run.

Prints all-reduce time and bus bandwidth (nccl-tests' definition: bytes * 2 (n-1)/n / s) per size
with the ratio ours / reference, then one ZeRO-1 optimizer step's communication (bucketed gradient
all-reduce + all-gather of the updated weights) for --params-m million fp32 parameters next to the
equivalent torch.distributed calls, and the bytes each rank moves per step.

    .venv/bin/python scripts/bench/dist.py --build build --ranks 2
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd, ranks):
    """Runs `cmd` as `ranks` processes (RANK, WORLD_SIZE, ...); returns rank 0's stdout lines."""
    port = str(free_port())
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                      text=True))
    out, _ = procs[0].communicate(timeout=1200)
    for p in procs[1:]:
        p.wait(timeout=1200)
    codes = [p.returncode for p in procs]
    if any(codes):
        sys.exit(f"dist.py: {cmd[0]} exited with {codes}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


REFERENCE = r'''
import json, os, statistics, sys, time
import torch, torch.distributed as dist
sizes_mb = [float(x) for x in sys.argv[1].split(",")]
iters, params_m, bucket_mb = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
n, rank = dist.get_world_size(), dist.get_rank()

def time_it(f):
    times = []
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter(); f(); s = time.perf_counter() - t0
        if i: times.append(s)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()

for mb in sizes_mb:
    x = torch.ones(int(mb * (1 << 20) / 4))
    s = time_it(lambda: dist.all_reduce(x))
    b = x.numel() * 4
    if rank == 0:
        print(json.dumps({"op": "all_reduce", "ranks": n, "bytes": b, "seconds": s,
                          "busbw_gbps": b * 2 * (n - 1) / n / s / 1e9}), flush=True)

# The same step as ours in PyTorch terms: buckets of gradients all-reduced (all in flight, then
# waited for), clip_grad_norm_ over the parameters, fused AdamW on this rank's slice, and the
# slices of the weights all-gathered.
per = int(params_m * 1e6) // 16 // 64 * 64
p = per * 16
chunk = (p + n - 1) // n
grads = torch.zeros(chunk * n)
weights = torch.zeros(chunk * n)
belems = int(bucket_mb * (1 << 20) / 4)
buckets = []
b = 0
while b < p:  # whole 'parameters' of `per` elements, as ours groups them
    e = b
    while e < p and e - b < belems:
        e += per
    buckets.append(grads[b:e if e < p else chunk * n])
    b = e
views = [weights[i * per:(i + 1) * per] for i in range(16)]
params = [torch.nn.Parameter(v) for v in views]
for prm, i in zip(params, range(16)):
    prm.grad = grads[i * per:(i + 1) * per]
shard = torch.nn.Parameter(weights[rank * chunk:(rank + 1) * chunk])
shard.grad = grads[rank * chunk:(rank + 1) * chunk]
opt = torch.optim.AdamW([shard], lr=1e-3, fused=True)
def step():
    grads.zero_()
    works = [dist.all_reduce(t, async_op=True) for t in buckets]
    for w in works: w.wait()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    t = torch.tensor([norm.item()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        opt.step()
    mine = weights[rank * chunk:(rank + 1) * chunk].clone()
    dist.all_gather_into_tensor(weights, mine)
s = time_it(step)
if rank == 0:
    print(json.dumps({"op": "zero_step", "ranks": n, "params": p, "seconds": s}), flush=True)
dist.destroy_process_group()
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes-mb", default="1,16,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--params-m", type=float, default=50)
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side is kept")
    a = ap.parse_args()

    # Rounds alternate ours and the reference, and each keeps its best round per measurement, so
    # that load from elsewhere on a shared machine falls on both alike.
    def best(runs):
        out = runs[0]
        for run in runs[1:]:
            out = [x if x["seconds"] <= y["seconds"] else y for x, y in zip(out, run)]
        return out
    ours_runs, ref_runs = [], []
    for _ in range(a.rounds):
        ours_runs.append(launch([os.path.join(a.build, "bench", "bench_dist"), f"--sizes_mb={a.sizes_mb}",
                                 f"--iters={a.iters}", f"--params_m={a.params_m}",
                                 f"--bucket_mb={a.bucket_mb}"], a.ranks))
        ref_runs.append(launch([sys.executable, "-c", REFERENCE, a.sizes_mb, str(a.iters), str(a.params_m),
                                str(a.bucket_mb)], a.ranks))
    ours, ref = best(ours_runs), best(ref_runs)

    print(f"Gloo on loopback, {a.ranks} ranks, 1 thread each (median of {a.iters}, slowest rank, "
          f"best of {a.rounds} alternating rounds)")
    print(f"{'all-reduce':>12} {'ours s':>9} {'ours GB/s':>10} {'torch s':>9} {'torch GB/s':>11} {'ratio':>6}")
    for o, r in zip([x for x in ours if x["op"] == "all_reduce"], [x for x in ref if x["op"] == "all_reduce"]):
        print(f"{o['bytes'] / 2**20:>9.0f} MiB {o['seconds']:>9.4f} {o['busbw_gbps']:>10.3f} "
              f"{r['seconds']:>9.4f} {r['busbw_gbps']:>11.3f} {r['seconds'] / o['seconds']:>5.2f}x")
    oz = next(x for x in ours if x["op"] == "zero_step")
    rz = next(x for x in ref if x["op"] == "zero_step")
    print(f"ZeRO-1 step (all-reduce, clip, AdamW on the slice, all-gather), {oz['params'] / 1e6:.1f}M fp32 parameters: ours {oz['seconds']:.4f} s, "
          f"torch.distributed {rz['seconds']:.4f} s, ratio {rz['seconds'] / oz['seconds']:.2f}x; "
          f"{oz['bytes_per_rank'] / 2**20:.0f} MiB moved per rank per step, "
          f"{oz['state_bytes_per_rank'] / 2**20:.0f} MiB of AdamW state per rank")


if __name__ == "__main__":
    main()
