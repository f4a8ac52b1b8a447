#!/usr/bin/env bash
# The GPU check on a GPU machine (docs/gpu.md): prepares a tree of GPU binaries, runs every GPU
# test's GPU cases (the list is the build's gpu_tests.txt, from tests/CMakeLists.txt), then the
# GPU benchmarks, and writes gpu_check.txt (a summary at its end), each test's XML and
# moe_kernels_bench.jsonl. Each part is a script of scripts/gpu/ that also runs alone.
#
#   scripts/gpu_check.sh                 build.sh (configure + build in build-gpu, kernels-only
#                                        unless OPD_GPU_FULL_BUILD=1), test.sh, bench.sh;
#                                        results in build-gpu/
#   scripts/gpu_check.sh --sanitize      the same, and test.sh --sanitize (compute-sanitizer)
#   scripts/gpu_check.sh --payload DIR   no build: unpack.sh DIR (binaries packed on a build
#                                        machine by scripts/gpu_payload.sh), test.sh --e2e,
#                                        bench.sh --iters 10, within OPD_GPU_BUDGET_S (default
#                                        360) seconds; results in gpu_check_out/
#   scripts/gpu_check.sh --fetch-debs    fetch_debs.sh: on a Debian 12 machine with apt, the
#                                        packages lm builds against, for a GPU machine without them
#
# Environment: OPD_GPU_RESULTS (the results folder), and those of the scripts of scripts/gpu/.
# Exit status: 0 when every step passed, else the first failing step's.
set -euo pipefail
GPU=$(cd "$(dirname "$0")/gpu" && pwd)
CHECKOUT=$(dirname "$(dirname "$GPU")")
cd "$CHECKOUT" # relative paths (DIR, OPD_BUILD_DIR) are the checkout's, as before the split
USAGE="usage: scripts/gpu_check.sh [--sanitize | --fetch-debs | --payload DIR]"
MODE=${1:-build}
case "$MODE" in
  --fetch-debs) [[ $# -eq 1 ]] || { echo "$USAGE" >&2; exit 2; }; exec "$GPU/fetch_debs.sh" ;;
  --payload)
    [[ $# -le 2 ]] || { echo "$USAGE" >&2; exit 2; }
    SRC=$(realpath -m "${2:-$CHECKOUT/gpu_payload}")
    export OPD_GPU_BUDGET_S=${OPD_GPU_BUDGET_S:-360}
    ;;
  build | --sanitize)
    [[ $# -le 1 ]] || { echo "$USAGE" >&2; exit 2; }
    BUILD=$(realpath -m "${OPD_BUILD_DIR:-$CHECKOUT/build-gpu}")
    export OPD_BUILD_DIR=$BUILD OPD_GPU_RESULTS=${OPD_GPU_RESULTS:-$BUILD}
    ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
# shellcheck source=scripts/gpu/common.sh
source "$GPU/common.sh"
say "== gpu_check $MODE ${SRC:-} $(date -u +%FT%TZ) on ${HOSTNAME:-?}, commit" \
  "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')${OPD_GPU_BUDGET_S:+, budget ${OPD_GPU_BUDGET_S}s}"
gpu_probe

status=0
step() { # a part; a failing one sets the status, and the next part runs
  local rc=0
  "$@" || rc=$?
  [[ $status != 0 ]] || status=$rc
}
if [[ "$MODE" == --payload ]]; then
  "$GPU/unpack.sh" "$SRC" # nothing to run without it
  TREE=$(payload_tree "$SRC")
  step "$GPU/test.sh" --e2e "$TREE"
  step "$GPU/bench.sh" --iters 10 "$TREE"
else
  "$GPU/build.sh"
  SAN=()
  [[ "$MODE" == --sanitize ]] && SAN=(--sanitize)
  step "$GPU/test.sh" "${SAN[@]}" "$BUILD"
  step "$GPU/bench.sh" --iters 20 "$BUILD"
fi
say "== summary (124: over its time)"
while read -r l; do say "  $l"; done <"$SUMMARY"
say "== done in $(elapsed)s, status $status; results in $RESULTS"
exit "$status"
