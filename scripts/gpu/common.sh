# shellcheck shell=bash
# Sourced by scripts/gpu/*.sh: the results file, one clock and budget for a whole run, the GPU
# probe, the python with torch, and a step's summary line.
#
# Environment (the first script of a run sets and exports what the later ones read):
#   OPD_GPU_RESULTS   folder of gpu_check.txt, the tests' XML and the benchmarks' JSON
#                     (default: gpu_check_out/ in the checkout)
#   OPD_GPU_START     the run's start (seconds since the epoch); unset: this script starts a run
#                     and empties gpu_check.txt
#   OPD_GPU_BUDGET_S  when set, every step's timeout shrinks so that the run fits in it
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

die() {
  echo "gpu_check: $*" >&2
  exit 1
}

export OPD_GPU_RESULTS=${OPD_GPU_RESULTS:-$ROOT/gpu_check_out}
mkdir -p "$OPD_GPU_RESULTS"
OPD_GPU_RESULTS=$(cd "$OPD_GPU_RESULTS" && pwd)
RESULTS=$OPD_GPU_RESULTS/gpu_check.txt
SUMMARY=$OPD_GPU_RESULTS/gpu_check.summary
if [[ -z "${OPD_GPU_START:-}" ]]; then
  OPD_GPU_START=$(date +%s)
  export OPD_GPU_START
  : >"$RESULTS"
  : >"$SUMMARY"
fi

say() { echo "$*" | tee -a "$RESULTS"; }
elapsed() { echo $(($(date +%s) - OPD_GPU_START)); }

# limit SECONDS [RESERVE]: a step's timeout. Without a budget SECONDS; with one, at most what is
# left of it less RESERVE seconds kept for later steps (never under 5).
limit() {
  local c=$1
  if [[ -n "${OPD_GPU_BUDGET_S:-}" ]]; then
    local left=$((OPD_GPU_BUDGET_S - $(elapsed) - ${2:-0}))
    ((left < c)) && c=$left
    ((c < 5)) && c=5
  fi
  echo "$c"
}

# step_done NAME RC T0: one line of the run's summary (printed by scripts/gpu_check.sh at the end).
step_done() {
  say "$1 exit status $2, $(($(elapsed) - $3))s"
  echo "$1 rc=$2 $(($(elapsed) - $3))s" >>"$SUMMARY"
}

# On a machine with nvidia-smi, a GPU test that finds no CUDA device fails (OPD_REQUIRE_GPU=1,
# tests/gpu.h) instead of skipping. Once per run.
gpu_probe() {
  [[ -z "${OPD_GPU_PROBED:-}" ]] || return 0
  export OPD_GPU_PROBED=1
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
      tee -a "$RESULTS" || true
    export OPD_REQUIRE_GPU=1
  else
    say "nvidia-smi not found"
  fi
}

# find_python CANDIDATES...: PY = the first that imports torch (OPD_PYTHON first).
find_python() {
  local cand
  PY=""
  for cand in "${OPD_PYTHON:-}" "$@"; do
    [[ -n "$cand" ]] || continue
    if "$cand" -c "import torch" >/dev/null 2>&1; then
      PY=$(command -v "$cand")
      break
    fi
  done
  [[ -n "$PY" ]] || die "no python with torch found (set OPD_PYTHON)"
}

# The torch wheel's library folders: torch/lib and site-packages/nvidia/*/lib.
torch_libs() {
  "$1" -c 'import torch, os, glob
d = os.path.dirname(torch.__file__)
print(":".join([d + "/lib"] + sorted(glob.glob(os.path.join(os.path.dirname(d), "nvidia", "*", "lib")))))'
}

# use_tree TREE: a build folder or an unpacked payload, with its gpu_tests.txt; its gpu_env.sh
# (written by scripts/gpu/build.sh or unpack.sh: the library path the binaries need) is sourced.
use_tree() {
  TREE=$(cd "$1" && pwd) || die "$1: no such folder"
  [[ -f "$TREE/gpu_tests.txt" ]] || die "$TREE/gpu_tests.txt missing (cmake writes it at configure time)"
  if [[ -f "$TREE/gpu_env.sh" ]]; then
    # shellcheck source=/dev/null
    source "$TREE/gpu_env.sh"
  fi
}

# payload_tree SRC: where the payload of SRC (scripts/gpu_payload.sh's folder) is unpacked:
# OPD_PAYLOAD_DIR (default /tmp/opd-gpu-payload) for SRC/payload.tar.xz, else SRC itself.
payload_tree() {
  if [[ -f "$1/payload.tar.xz" ]]; then
    echo "${OPD_PAYLOAD_DIR:-/tmp/opd-gpu-payload}"
  else
    echo "$1"
  fi
}
