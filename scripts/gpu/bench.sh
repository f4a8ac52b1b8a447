#!/usr/bin/env bash
# Runs the GPU benchmarks of a tree (a build folder, or an unpacked payload):
#   bench_moe_kernels    the MoE kernels against a per-expert loop of library GEMMs (decode in a
#                        CUDA graph, prefill, the learner's forward + backward, the kernels
#                        against at::_grouped_mm); its JSON lines in moe_kernels_bench.jsonl
#   bench_paged_decode   the paged decode kernel against gather + SDPA, B = 1, 64, 256 x
#                        L = 512, 4k, 8k, up to 40 GB of KV pools
# Their output goes to gpu_check.txt (scripts/gpu/common.sh).
#
#   scripts/gpu/bench.sh [--iters N] TREE      (N default 20)
#
# Timeouts 240 s and 180 s, or with OPD_GPU_BUDGET_S at most 60 s (35 s kept for the second) and
# what is left. Exit status: the first failure's (124: over its time).
# shellcheck source=scripts/gpu/common.sh
source "$(dirname "$0")/common.sh"
ITERS=20
if [[ "${1:-}" == "--iters" ]]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "--iters takes a positive whole number"
  ITERS=$2
  shift 2
fi
[[ $# -eq 1 ]] || die "usage: scripts/gpu/bench.sh [--iters N] TREE"
use_tree "$1"
gpu_probe
status=0

if [[ -n "${OPD_GPU_BUDGET_S:-}" ]]; then MOE_LIM=$(limit 60 35); else MOE_LIM=240; fi
t0=$(elapsed) rc=0
if [[ -x "$TREE/bench/bench_moe_kernels" ]]; then
  say "== bench_moe_kernels --iters $ITERS, t=${t0}s"
  rm -f "$OPD_GPU_RESULTS/moe_kernels_bench.jsonl"
  timeout -k 5 "$MOE_LIM" "$TREE/bench/bench_moe_kernels" --iters "$ITERS" \
    --json "$OPD_GPU_RESULTS/moe_kernels_bench.jsonl" 2>&1 | tee -a "$RESULTS" || rc=$?
else
  say "== bench_moe_kernels: not in $TREE/bench (a build without nvcc)"
  rc=127
fi
step_done bench_moe_kernels "$rc" "$t0"
[[ $status != 0 ]] || status=$rc

if [[ -n "${OPD_GPU_BUDGET_S:-}" ]]; then PAGED_LIM=$(limit 35); else PAGED_LIM=180; fi
t0=$(elapsed) rc=0
say "== bench_paged_decode (B = 1, 64, 256 x L = 512, 4k, 8k), t=${t0}s"
timeout -k 5 "$PAGED_LIM" "$TREE/bench/bench_paged_decode" --device cuda --iters "$ITERS" \
  --max_gb 40 2>&1 | tee -a "$RESULTS" || rc=$?
step_done bench_paged_decode "$rc" "$t0"
[[ $status != 0 ]] || status=$rc
exit "$status"
