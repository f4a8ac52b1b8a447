#!/usr/bin/env bash
# Benchmarks: ours and the reference side by side, in one run, on the same inputs.
# Run after ./scripts/test.sh (or a build). Each section prints both figures and the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target bench_forward bench_tokenizer >/dev/null
PY=.venv/bin/python
mkdir -p build/bench

echo "== model forward (per-token log-probs) =="
$PY scripts/bench/forward.py --build build --workdir build/bench

if [ -x scripts/bench_tokenizer.sh ]; then
  echo "== tokenizer =="
  ./scripts/bench_tokenizer.sh build
fi

echo "== Qwen3-Next scoring (stage-2 teacher, 2048-token prefill) =="
$PY scripts/bench/qwen3_next.py --build build --workdir build/bench

# The services: built here because the sections above only need the forward and tokenizer.
cmake --build build -j"$(nproc)" --target bench_serving opd-teacher opd-rollout >/dev/null

echo "== teacher scoring through gRPC (opd-teacher) =="
$PY scripts/bench/teacher.py --build build --workdir build/bench

echo "== bf16 teacher scoring on the CPU: ours bf16 vs transformers bf16 vs ours fp32, kernels used =="
$PY scripts/bench/bf16_scoring.py --build build --workdir build/bench

echo "== rollout sampling through gRPC (opd-rollout) =="
$PY scripts/bench/rollout.py --build build --workdir build/bench

echo "== Qwen3-Next student rollout (recurrent-state caching) vs transformers generate =="
$PY scripts/bench/qwen3_next_rollout.py --build build --workdir build/bench

echo "== rollout engine (paged KV, continuous batching) vs static sampler vs transformers, long tail =="
cmake --build build -j"$(nproc)" --target bench_rollout_engine >/dev/null
$PY scripts/bench/rollout_engine.py --build build --workdir build/bench

echo "== paged decode attention, one layer (Qwen3-30B-A3B heads): CPU kernel vs gather + SDPA =="
cmake --build build -j"$(nproc)" --target bench_paged_decode >/dev/null
build/bench/bench_paged_decode --device cpu --iters 3 --max_gb 4

# The engine's decode with the kernel and without it (OPD_PAGED_DECODE=gather: decode steps go
# down the varlen prefill path, every layer gathering each sequence's K/V), on the model above:
# the long-tail workload, then 32 prompts of 1,024 tokens x 2 samples x 128 new tokens.
echo "== rollout engine decode tokens/s: paged decode kernel vs gathered K/V =="
$PY -c "import json, random; r = random.Random(2)
json.dump([{'prompt': [r.randrange(32000) for _ in range(1024)], 'max_new': 128}
           for _ in range(32)], open('build/bench/paged_decode_long.json', 'w'))"
for reqs in rollout_engine_requests paged_decode_long; do
  for path in kernel gather; do
    OPD_PAGED_DECODE=$path build/bench/bench_rollout_engine \
      --model=build/bench/qwen3moe_h256_l4_e32_v32k --requests="build/bench/$reqs.json" \
      --mode=engine --threads="$(nproc)" --samples=2 --kv_cache_gb=1 | tail -1 |
      $PY -c "import json, sys; r = json.load(sys.stdin); \
print(f'  $reqs, $path: {r[\"tokens_per_s\"]:.1f} tokens/s (prefill included)')"
  done
done

echo "== SFT training step (forward + backward + optimizer) =="
cmake --build build -j"$(nproc)" --target opd-trainer >/dev/null
$PY scripts/bench/sft.py --build build --workdir build/bench

echo "== OPD step: sampling / scoring / learning / push, phase by phase vs pipelined, and one-step-off =="
cmake --build build -j"$(nproc)" --target opd-ctl >/dev/null
$PY scripts/bench/opd_pipeline.py --build build --workdir build/bench --compare pipeline
$PY scripts/bench/opd_pipeline.py --build build --workdir build/bench --compare async

echo "== learner collectives: Gloo all-reduce and one ZeRO-1 step, ours vs torch.distributed =="
cmake --build build -j"$(nproc)" --target bench_dist >/dev/null
$PY scripts/bench/dist.py --build build --ranks 2

echo "== weight sync: a 1.0B-parameter push (bf16 wire) to opd-rollout, gRPC streaming vs Gloo =="
cmake --build build -j"$(nproc)" --target bench_weight_sync opd-rollout >/dev/null
$PY scripts/bench/weight_sync.py --build build --workdir build/bench

echo "== weight push: rank 0's star vs every learner rank's share (2 ranks x 2 bf16 workers) =="
cmake --build build -j"$(nproc)" --target bench_weight_publish opd-rollout >/dev/null
$PY scripts/bench/weight_publish.py --build build --workdir build/bench
