#!/usr/bin/env bash
# Runs the GPU cases of every GPU test of a tree (a build folder, or an unpacked payload): the
# lines "NAME FILTER SECONDS" of its gpu_tests.txt, which cmake writes from tests/CMakeLists.txt
# (lm_test_gpu). Each binary runs its FILTER from the tree's tests/ folder, its XML next to
# gpu_check.txt; OPD_REQUIRE_GPU=1 where nvidia-smi exists, so that a GPU case that finds no
# device fails instead of skipping.
#
#   scripts/gpu/test.sh [--sanitize] [--e2e] TREE
#     --sanitize   also runs small cases of moe_kernels_test under compute-sanitizer (memcheck,
#                  racecheck, synccheck)
#     --e2e        then the job end to end on this GPU (scripts/gpu_e2e.sh: SFT, then two-stage
#                  cascaded OPD with every process on cuda:0; the tree needs the servers)
#
# Each binary's timeout: 300 s, or with OPD_GPU_BUDGET_S its SECONDS, shrunk so that 95 s of the
# budget stay for scripts/gpu/bench.sh. Exit status: the first failure's (124: over its time).
# shellcheck source=scripts/gpu/common.sh
source "$(dirname "$0")/common.sh"
SANITIZE=0 E2E=0
while [[ $# -gt 1 ]]; do
  case "$1" in
    --sanitize) SANITIZE=1 ;;
    --e2e) E2E=1 ;;
    *) die "usage: scripts/gpu/test.sh [--sanitize] [--e2e] TREE" ;;
  esac
  shift
done
[[ $# -eq 1 && "$1" != --* ]] || die "usage: scripts/gpu/test.sh [--sanitize] [--e2e] TREE"
use_tree "$1"
gpu_probe
BENCH_RESERVE=95

# Cases that read a fixture set the tree may lack (scripts/gpu/build.sh could not make it: no
# transformers): left out, with a line saying so. FIXTURES_DIR:gtest pattern.
NEEDS_FIXTURES=("fixtures_fp8:*GpuFp8*" "fixtures_bf16:Bf16Serving.*")
without_missing_fixtures() { # FILTER -> FILTER less the cases whose fixtures are missing
  local filter=$1 n dir pat
  for n in "${NEEDS_FIXTURES[@]}"; do
    dir=${n%%:*} pat=${n#*:}
    [[ "$filter" == *"$pat"* && ! -d "$TREE/$dir" ]] || continue
    say "($TREE/$dir missing: $pat left out)" >&2
    if [[ "$filter" == *-* ]]; then filter+=":$pat"; else filter+="-$pat"; fi
  done
  echo "$filter"
}

status=0
while read -r bin filter secs; do
  [[ -n "$bin" && "$bin" != \#* ]] || continue
  t0=$(elapsed) rc=0
  if [[ ! -x "$TREE/tests/$bin" ]]; then
    say "== $bin: not in $TREE/tests"
    rc=127
  else
    filter=$(without_missing_fixtures "$filter")
    if [[ -n "${OPD_GPU_BUDGET_S:-}" ]]; then lim=$(limit "$secs" "$BENCH_RESERVE"); else lim=300; fi
    say "== $bin ($filter, at most ${lim}s), t=${t0}s"
    (cd "$TREE/tests" && timeout -k 5 "$lim" "$TREE/tests/$bin" --gtest_color=no \
      --gtest_filter="$filter" --gtest_output="xml:$OPD_GPU_RESULTS/$bin.xml" </dev/null) 2>&1 |
      tee -a "$RESULTS" || rc=$?
  fi
  step_done "$bin" "$rc" "$t0"
  [[ $status != 0 ]] || status=$rc
done <"$TREE/gpu_tests.txt"

if [[ $SANITIZE == 1 ]]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck synccheck; do
    t0=$(elapsed) rc=0
    say "== compute-sanitizer --tool $tool moe_kernels_test, t=${t0}s"
    timeout 300 "$SAN" --tool "$tool" --error-exitcode 9 "$TREE/tests/moe_kernels_test" \
      --gtest_color=no --gtest_filter='*Align*:*Topk*:*Backward*:*Fp32Layer*' 2>&1 |
      tail -25 | tee -a "$RESULTS" || rc=$?
    step_done "compute-sanitizer $tool" "$rc" "$t0"
    [[ $status != 0 ]] || status=$rc
  done
fi

if [[ $E2E == 1 ]]; then
  t0=$(elapsed) rc=0 lim=$(limit 60 "$BENCH_RESERVE")
  say "== gpu_e2e (SFT + 2-stage OPD on cuda:0, at most ${lim}s), t=${t0}s"
  timeout -k 5 "$lim" bash "$ROOT/scripts/gpu_e2e.sh" "$TREE" "${TMPDIR:-/tmp}/opd-gpu-e2e" 2>&1 |
    tee -a "$RESULTS" || rc=$?
  step_done gpu_e2e "$rc" "$t0"
  [[ $status != 0 ]] || status=$rc
fi
exit "$status"
