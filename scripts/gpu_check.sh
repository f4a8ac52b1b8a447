#!/usr/bin/env bash
# Builds the CUDA MoE kernels with their test and benchmark (a CMake configuration with
# -DOPD_KERNELS_ONLY=ON: lm, kernels/, moe_kernels_test, bench_moe_kernels, attention_test,
# paged_decode_test, fused_ops_test, keyed_draw_test and bench_paged_decode; no gRPC) and the bf16
# placement test (bf16_test: loading to the GPU in bf16, scoring there, the host memory of that
# load) and the FP8 GEMMs' test (fp8_test: kernels against their CPU twin, an FP8 checkpoint's model
# against its dequantized bf16 self), and runs them on a GPU machine, in well under 5 minutes on 16 cores. With
# OPD_GPU_FULL_BUILD=1 (a machine with gRPC & co.) it configures the full build instead:
# bf16_test also serves a bf16 opd-teacher on the GPU, and the other GPU cases run (the bf16-mixed
# learner, the paged engine's bf16 KV cache, the device draw, Qwen3-Next bf16 decode, weight
# sync). Results: gpu_check.txt (and moe_kernels_bench.jsonl, the tests' XML) in $OUT when the
# device tool runs it, else in build-gpu/.
#
#   scripts/gpu_check.sh                 on the GPU machine (its python3 has torch 2.11 + CUDA)
#   scripts/gpu_check.sh --sanitize      also runs small test cases under compute-sanitizer
#   scripts/gpu_check.sh --payload DIR   no build: runs every GPU test and the GPU benchmarks
#                                        from a payload that scripts/gpu_payload.sh assembled
#                                        (DIR/payload.tar.xz; carry DIR), in OPD_GPU_BUDGET_S
#                                        (default 360) seconds; docs/gpu.md "The first GPU run"
#   scripts/gpu_check.sh --fetch-debs    on a machine with apt (Debian 12): downloads into
#                                        .gpu_debs/ (git-ignored through .git/info/exclude) the
#                                        packages lm builds against, for GPU machines that lack
#                                        them; carry .gpu_debs along (the script unpacks them
#                                        into a private prefix, never into /)
#
# Environment: OPD_PYTHON (a python with torch), OPD_BUILD_DIR (default build-gpu),
# OPD_GPU_FULL_BUILD (1: full build, not kernels-only),
# OPD_CUDA_ARCHITECTURES (default "80;90a"), OPD_JOBS (default: all cores). Where nvidia-smi
# exists, OPD_REQUIRE_GPU=1 turns a GPU test that finds no CUDA device into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEBS=(libabsl-dev libabsl20220623 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  nlohmann-json3-dev libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libgtest-dev
  pkgconf pkgconf-bin libpkgconf3)

die() {
  echo "gpu_check: $*" >&2
  exit 1
}

if [[ "${1:-}" == "--fetch-debs" ]]; then
  command -v apt-get >/dev/null || die "--fetch-debs needs apt-get (a Debian/Ubuntu machine)"
  [[ "$(uname -m)" == "x86_64" ]] || die "--fetch-debs: run it on x86-64 (the GPU machine is)"
  mkdir -p .gpu_debs
  if [[ -d .git ]] && ! grep -qx '/.gpu_debs/' .git/info/exclude 2>/dev/null; then
    echo '/.gpu_debs/' >>.git/info/exclude
  fi
  (cd .gpu_debs && apt-get download "${DEBS[@]}" &&
    for f in *.deb; do [[ "$f" == "${f//[^A-Za-z0-9._-]/_}" ]] || mv "$f" "${f//[^A-Za-z0-9._-]/_}"; done)
  du -sh .gpu_debs
  echo "gpu_check: carry .gpu_debs to the GPU machine and run scripts/gpu_check.sh there"
  exit 0
fi

# --payload DIR: the binaries of scripts/gpu_payload.sh, no cmake, no Debian packages. Only the
# image's python3 with its torch wheel is needed: LibTorch and the CUDA libraries come from that
# wheel through LD_LIBRARY_PATH, every other library from the payload's lib/.
if [[ "${1:-}" == "--payload" ]]; then
  [[ $# -le 2 ]] || die "usage: scripts/gpu_check.sh --payload [DIR]"
  SRC=$(realpath -m "${2:-gpu_payload}")
  RESULTS_DIR=${OUT:-$ROOT/gpu_check_out}
  mkdir -p "$RESULTS_DIR"
  RESULTS=$RESULTS_DIR/gpu_check.txt
  : >"$RESULTS"
  say() { echo "$*" | tee -a "$RESULTS"; }
  START=$(date +%s)
  elapsed() { echo $(($(date +%s) - START)); }
  BUDGET=${OPD_GPU_BUDGET_S:-360}
  # cap SECONDS [RESERVE]: SECONDS, or less so that RESERVE seconds of the budget stay for later.
  cap() { local c=$1 l=$((BUDGET - $(elapsed) - ${2:-0})); ((l < c)) && c=$l; ((c < 5)) && c=5; echo "$c"; }
  say "== gpu_check --payload $SRC $(date -u +%FT%TZ) on ${HOSTNAME:-?}, budget ${BUDGET}s"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
      tee -a "$RESULTS" || true
    export OPD_REQUIRE_GPU=1
  else
    say "nvidia-smi not found"
  fi
  IMAGE_LDP=${LD_LIBRARY_PATH:-}
  PY=$(command -v "${OPD_PYTHON:-python3}") || die "no python3 (set OPD_PYTHON)"
  "$PY" -c "import torch" >/dev/null 2>&1 || die "$PY cannot import torch"
  say "python: $PY, $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')"
  P=$SRC
  if [[ -f "$SRC/payload.tar.xz" ]]; then
    P=${OPD_PAYLOAD_DIR:-/tmp/opd-gpu-payload}
    rm -rf "$P"
    mkdir -p "$P"
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$SRC/payload.tar.xz" "$P" || die "cannot unpack $SRC/payload.tar.xz"
  fi
  [[ -f "$P/BAKED" && -d "$P/lib" ]] || die "$SRC: no payload (scripts/gpu_payload.sh makes it)"
  declare -A BAKED=()
  while IFS='=' read -r k v; do BAKED[$k]=$v; done <"$P/BAKED"
  say "payload: $(tr '\n' ' ' <"$P/BAKED"), unpacked in $(elapsed)s"
  # glibc is the image's: it must be as new as the payload's binaries need.
  ver_ge() { [[ "$(printf '%s\n%s\n' "${1#GLIBC*_}" "${2#GLIBC*_}" | sort -V | head -1)" == "${2#GLIBC*_}" ]]; }
  GLIBC=$("$PY" -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split()[1])')
  ver_ge "$GLIBC" "${BAKED[GLIBC_NEEDED]}" || die "image glibc $GLIBC < ${BAKED[GLIBC_NEEDED]} the payload needs"
  # libstdc++: the image's when it has the newest GLIBCXX needed, else the carried one.
  IMG_CXX=$( (/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null) | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}' || true)
  for c in "$IMG_CXX" /usr/lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6 /lib64/libstdc++.so.6; do
    [[ -n "$c" && -e "$c" ]] && { IMG_CXX=$c; break; }
  done
  LIBS=$P/lib
  if [[ -n "$IMG_CXX" ]] && grep -qa "${BAKED[GLIBCXX_NEEDED]}" "$IMG_CXX"; then
    say "glibc $GLIBC; libstdc++: the image's $IMG_CXX (has ${BAKED[GLIBCXX_NEEDED]})"
  else
    ver_ge "$GLIBC" "${BAKED[GLIBC_NEEDED_CXX]}" ||
      die "the image's libstdc++ (${IMG_CXX:-none}) lacks ${BAKED[GLIBCXX_NEEDED]}, the carried one needs ${BAKED[GLIBC_NEEDED_CXX]} > glibc $GLIBC"
    LIBS=$P/lib:$P/lib/cxx
    say "glibc $GLIBC; libstdc++: the carried one (the image's ${IMG_CXX:-none} lacks ${BAKED[GLIBCXX_NEEDED]})"
  fi
  TORCH_LIBS=$("$PY" -c 'import torch, os, glob
d = os.path.dirname(torch.__file__)
print(":".join([d + "/lib"] + sorted(glob.glob(os.path.join(os.path.dirname(d), "nvidia", "*", "lib")))))')
  export LD_LIBRARY_PATH=$LIBS:$TORCH_LIBS
  # The tests have the build machine's absolute paths compiled in (OPD_SOURCE_DIR, OPD_BINARY_DIR
  # with the fixtures, OPD_PYTHON) and no override: recreate them as links to this tree, the
  # payload and a python3 wrapper that runs without the payload's libraries.
  S=${BAKED[OPD_SOURCE_DIR]} B=${BAKED[OPD_BINARY_DIR]} BP=${BAKED[OPD_PYTHON]}
  if [[ "$(realpath -m "$S")" != "$ROOT" ]]; then
    [[ ! -e "$S" || -L "$S" ]] || die "$S exists and is not this tree: the tests' paths cannot be made"
    mkdir -p "$(dirname "$S")"
    ln -sfn "$ROOT" "$S"
  fi
  if [[ -L "$B" || ! -e "$B" ]]; then
    mkdir -p "$(dirname "$B")"
    ln -sfn "$P" "$B"
  elif [[ "$(realpath "$B")" != "$(realpath "$P")" ]]; then
    die "$B is a directory here: move it away (the tests read the payload through that path)"
  fi
  # (a python of its own there is kept; only a missing one or an earlier wrapper is (re)written)
  if [[ ! -e "$BP" ]] || grep -qs '^# opd gpu_check wrapper' "$BP"; then
    mkdir -p "$(dirname "$BP")"
    rm -f "$BP"
    if [[ -n "$IMAGE_LDP" ]]; then
      printf '#!/bin/sh\n# opd gpu_check wrapper\nexport LD_LIBRARY_PATH=%q\nexec %q "$@"\n' "$IMAGE_LDP" "$PY" >"$BP"
    else
      printf '#!/bin/sh\n# opd gpu_check wrapper\nunset LD_LIBRARY_PATH\nexec %q "$@"\n' "$PY" >"$BP"
    fi
    chmod +x "$BP"
  fi
  say "paths: $S -> $(realpath "$S"), $B -> $(realpath "$B"), $BP -> $PY"
  if [[ "${OPD_MAKE_FIXTURES:-0}" == 1 ]]; then  # remake them with the image's python (transformers)
    for f in fixtures:make_fixtures fixtures_bf16:make_bf16_fixtures fixtures_next:make_next_fixtures \
      fixtures_sft:make_sft_fixtures fixtures_fp8:make_fp8_fixtures; do
      rm -rf "$P/${f%%:*}.new"
      if timeout "$(cap 120 150)" "$BP" "$ROOT/tests/python/${f#*:}.py" --out "$P/${f%%:*}.new" \
        >"$RESULTS_DIR/${f#*:}.log" 2>&1; then
        rm -rf "$P/${f%%:*}" && mv "$P/${f%%:*}.new" "$P/${f%%:*}"
        say "${f#*:}: remade, t=$(elapsed)s"
      else
        say "${f#*:}: failed (log ${f#*:}.log), the carried fixtures stay, t=$(elapsed)s"
      fi
    done
  fi
  BENCH_RESERVE=95
  # binary|gtest filter|seconds at most: every GPU case of the suites.
  GPU_CASES=(
    "moe_kernels_test|*|60"
    "attention_test|VarlenAttentionGpu.*|20"
    "paged_decode_test|PagedDecode.Cuda*|45"
    "fused_ops_test|FusedOps.*Cuda*|20"
    "keyed_draw_test|KeyedDraw.Cuda*|20"
    "bf16_test|Placement.*:Bf16Gpu.*:Bf16Serving.*|45"
    "mixed_precision_test|PrecisionGpu.*:MixedOptimizerGpu.*:LearnerDevice.*|45"
    "engine_test|PagedKV.AttentionOnCuda*:Engine.CudaBf16KvCache|25"
    "sampler_test|Sampler.DeviceDrawOnCudaEqualsCpu|20"
    "qwen3_next_test|NextModel.Bf16DecodeStaysCloseCuda|25"
    "weight_sync_test|WeightSyncGpu.*|45"
    "fp32_logits_test|Fp32Logits.*Cuda*|25"
    "fp8_test|Fp8Cuda.*:*GpuFp8*|45"
  )
  status=0
  SUMMARY=()
  for c in "${GPU_CASES[@]}"; do
    IFS='|' read -r bin filter secs <<<"$c"
    [[ -x "$P/tests/$bin" ]] || { say "== $bin: not in the payload"; continue; }
    t0=$(elapsed) lim=$(cap "$secs" "$BENCH_RESERVE") rc=0
    say "== $bin ($filter, at most ${lim}s), t=${t0}s"
    (cd "$P/tests" && timeout -k 5 "$lim" "$P/tests/$bin" --gtest_color=no --gtest_filter="$filter" \
      --gtest_output="xml:$RESULTS_DIR/$bin.xml") 2>&1 | tee -a "$RESULTS" || rc=$?
    say "$bin exit status $rc, $(($(elapsed) - t0))s"
    SUMMARY+=("$bin rc=$rc $(($(elapsed) - t0))s")
    [[ $status != 0 ]] || status=$rc
  done
  # The job end to end on this GPU (SFT, then cascaded OPD with every process on cuda:0).
  t0=$(elapsed) rc=0
  say "== gpu_e2e (SFT + 2-stage OPD on cuda:0, at most $(cap 60 "$BENCH_RESERVE")s), t=${t0}s"
  OPD_PYTHON=$BP timeout -k 5 "$(cap 60 "$BENCH_RESERVE")" bash "$ROOT/scripts/gpu_e2e.sh" "$P" \
    /tmp/opd-gpu-e2e 2>&1 | tee -a "$RESULTS" || rc=$?
  SUMMARY+=("gpu_e2e rc=$rc $(($(elapsed) - t0))s")
  [[ $status != 0 ]] || status=$rc
  t0=$(elapsed) rc=0
  say "== bench_moe_kernels, t=${t0}s"
  timeout -k 5 "$(cap 60 35)" "$P/bench/bench_moe_kernels" --iters 10 \
    --json "$RESULTS_DIR/moe_kernels_bench.jsonl" 2>&1 | tee -a "$RESULTS" || rc=$?
  SUMMARY+=("bench_moe_kernels rc=$rc $(($(elapsed) - t0))s")
  [[ $status != 0 ]] || status=$rc
  t0=$(elapsed) rc=0
  say "== bench_paged_decode (B = 1, 64, 256 x L = 512, 4k, 8k), t=${t0}s"
  timeout -k 5 "$(cap 35)" "$P/bench/bench_paged_decode" --device cuda --iters 10 --max_gb 40 2>&1 |
    tee -a "$RESULTS" || rc=$?
  SUMMARY+=("bench_paged_decode rc=$rc $(($(elapsed) - t0))s")
  [[ $status != 0 ]] || status=$rc
  say "== summary (124: over its time)"
  for l in "${SUMMARY[@]}"; do say "  $l"; done
  say "== done in $(elapsed)s, status $status; results in $RESULTS"
  exit "$status"
fi

SANITIZE=0
[[ "${1:-}" == "--sanitize" ]] && SANITIZE=1
[[ $# -le 1 ]] || die "usage: scripts/gpu_check.sh [--sanitize | --fetch-debs | --payload DIR]"

BUILD=${OPD_BUILD_DIR:-$ROOT/build-gpu}
RESULTS_DIR=${OUT:-$BUILD}
mkdir -p "$BUILD" "$RESULTS_DIR"
RESULTS=$RESULTS_DIR/gpu_check.txt
: >"$RESULTS"
say() { echo "$*" | tee -a "$RESULTS"; }
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }

say "== gpu_check $(date -u +%FT%TZ) on ${HOSTNAME:-?}, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
    tee -a "$RESULTS" || true
  export OPD_REQUIRE_GPU=1  # a GPU machine: GPU tests that cannot find the device fail
else
  say "nvidia-smi not found"
fi

# A python whose torch is the LibTorch we build against.
PY=""
for cand in "${OPD_PYTHON:-}" "$ROOT/.venv/bin/python" python3 /opt/torch/.venv/bin/python3; do
  [[ -n "$cand" ]] || continue
  if "$cand" -c "import torch" >/dev/null 2>&1; then
    PY=$(command -v "$cand")
    break
  fi
done
[[ -n "$PY" ]] || die "no python with torch found (set OPD_PYTHON)"
say "python: $PY, $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')"

# nvcc: on PATH, or the toolkit's default place.
if [[ -z "${CUDACXX:-}" ]]; then
  if command -v nvcc >/dev/null; then
    export CUDACXX=$(command -v nvcc)
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  else
    die "nvcc not found (set CUDACXX)"
  fi
fi
say "nvcc: $CUDACXX ($("$CUDACXX" --version | tail -1))"
command -v cmake >/dev/null || die "cmake not found"
command -v ninja >/dev/null || die "ninja not found"

# Build dependencies of lm that the GPU image may lack, from carried Debian packages unpacked
# into a private prefix.
CMAKE_EXTRA=()
if compgen -G "$ROOT/.gpu_debs/*.deb" >/dev/null; then
  DEPS=/tmp/opd-gpu-deps
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  for deb in "$ROOT"/.gpu_debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$DEPS"
    else  # a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$DEPS")
      rm -rf "$tmp"
    fi
  done
  LIBDIR=$DEPS/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH=$DEPS/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_LIBDIR=$LIBDIR/pkgconfig:$DEPS/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$DEPS
  export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ! command -v pkg-config >/dev/null; then
    CMAKE_EXTRA+=("-DPKG_CONFIG_EXECUTABLE=$DEPS/usr/bin/pkgconf")
  fi
  say "unpacked $(ls "$ROOT"/.gpu_debs/*.deb | wc -l) carried packages into $DEPS"
fi

JOBS=${OPD_JOBS:-$(nproc)}
say "== configure + build (jobs $JOBS), t=$(elapsed)s"
set -o pipefail
KERNELS_ONLY=ON
BF16_TARGETS=(bf16_test load_rss_probe fp8_test)
if [[ "${OPD_GPU_FULL_BUILD:-0}" == 1 ]]; then
  KERNELS_ONLY=OFF
  BF16_TARGETS+=(opd-teacher)
  # The other GPU cases of the full build: test binary and its GPU filter.
  FULL_GPU_TESTS=(
    "mixed_precision_test:PrecisionGpu.*:MixedOptimizerGpu.*:LearnerDevice.*"
    "engine_test:PagedKV.AttentionOnCuda*:Engine.CudaBf16KvCache"
    "sampler_test:Sampler.DeviceDrawOnCudaEqualsCpu"
    "qwen3_next_test:NextModel.Bf16DecodeStaysCloseCuda"
    "weight_sync_test:WeightSyncGpu.*"
  )
  for t in "${FULL_GPU_TESTS[@]}"; do BF16_TARGETS+=("${t%%:*}"); done
  BF16_TARGETS+=(opd-rollout opd-ctl)
fi
timeout 300 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPD_KERNELS_ONLY=$KERNELS_ONLY \
  -DOPD_PYTHON="$PY" -DOPD_CUDA_ARCHITECTURES="${OPD_CUDA_ARCHITECTURES:-80;90a}" \
  "${CMAKE_EXTRA[@]}" >"$BUILD/configure.log" 2>&1 ||
  { tail -40 "$BUILD/configure.log" | tee -a "$RESULTS"; die "configure failed (log: $BUILD/configure.log; missing packages? see --fetch-debs)"; }
ATTENTION_TARGETS=(attention_test paged_decode_test fused_ops_test keyed_draw_test bench_paged_decode)
timeout 600 cmake --build "$BUILD" -j "$JOBS" --target moe_kernels_test bench_moe_kernels \
  "${ATTENTION_TARGETS[@]}" "${BF16_TARGETS[@]}" \
  >"$BUILD/build.log" 2>&1 ||
  { tail -60 "$BUILD/build.log" | tee -a "$RESULTS"; die "build failed (log: $BUILD/build.log)"; }
say "built in $(elapsed)s"

status=0
say "== moe_kernels_test, t=$(elapsed)s"
timeout 300 "$BUILD/tests/moe_kernels_test" --gtest_color=no \
  --gtest_output="xml:$RESULTS_DIR/moe_kernels_test.xml" 2>&1 | tee -a "$RESULTS" || status=$?
say "moe_kernels_test exit status $status, t=$(elapsed)s"

# Packed (FlashAttention varlen) and paged decode attention, the fused small ops and the keyed
# token draw against their references.
for bin in attention_test paged_decode_test fused_ops_test keyed_draw_test; do
  say "== $bin, t=$(elapsed)s"
  rc=0
  timeout 300 "$BUILD/tests/$bin" --gtest_color=no \
    --gtest_output="xml:$RESULTS_DIR/$bin.xml" 2>&1 | tee -a "$RESULTS" || rc=$?
  say "$bin exit status $rc, t=$(elapsed)s"
  [[ $status != 0 ]] || status=$rc
done

# bf16 on the GPU. The parity and serving cases need transformers' bf16 references: made here
# when this python has transformers, else only the cases that need none run.
BF16_FILTER='Placement.*:Bf16Cpu.*:Bf16Gpu.*:LoadMemory.*'
if "$PY" -c "import transformers, safetensors" >/dev/null 2>&1 &&
  timeout 300 "$PY" "$ROOT/tests/python/make_bf16_fixtures.py" --out "$BUILD/fixtures_bf16" \
    >"$BUILD/bf16_fixtures.log" 2>&1; then
  BF16_FILTER='*'
else
  say "bf16 fixtures not made (no transformers in $PY?): parity cases skipped"
fi
say "== bf16_test ($BF16_FILTER), t=$(elapsed)s"
bf16_status=0
timeout 300 "$BUILD/tests/bf16_test" --gtest_color=no --gtest_filter="$BF16_FILTER" \
  --gtest_output="xml:$RESULTS_DIR/bf16_test.xml" 2>&1 | tee -a "$RESULTS" || bf16_status=$?
say "bf16_test exit status $bf16_status, t=$(elapsed)s"
[[ $status != 0 ]] || status=$bf16_status

# The FP8 GEMMs against their CPU twin, and an FP8 checkpoint's model against its dequantized
# bf16 self (tests/fp8_test.cc); the model cases need the FP8 fixtures (transformers).
FP8_FILTER='Fp8Cuda.*'
if timeout 120 "$PY" "$ROOT/tests/python/make_fp8_fixtures.py" --out "$BUILD/fixtures_fp8" \
  >"$BUILD/fp8_fixtures.log" 2>&1; then
  FP8_FILTER='Fp8Cuda.*:*GpuFp8*'
else
  say "FP8 fixtures not made (no transformers in $PY?): the model cases skipped"
fi
say "== fp8_test ($FP8_FILTER), t=$(elapsed)s"
rc=0
timeout 300 "$BUILD/tests/fp8_test" --gtest_color=no --gtest_filter="$FP8_FILTER" \
  --gtest_output="xml:$RESULTS_DIR/fp8_test.xml" 2>&1 | tee -a "$RESULTS" || rc=$?
say "fp8_test exit status $rc, t=$(elapsed)s"
[[ $status != 0 ]] || status=$rc

# Full build only: the learner's bf16-mixed, the paged engine's bf16 KV cache, the sampler's
# device draw, Qwen3-Next bf16 decoding and collective weight sync, on the GPU. Their fixtures
# come from the same scripts ctest runs (tests/CMakeLists.txt).
if [[ "${OPD_GPU_FULL_BUILD:-0}" == 1 ]]; then
  (cd "$BUILD" && timeout 600 ctest -R 'make_(fixtures|next_fixtures|sft_fixtures)$'     >"$BUILD/fixtures.log" 2>&1) || say "fixtures not made (log: $BUILD/fixtures.log)"
  for t in "${FULL_GPU_TESTS[@]}"; do
    bin=${t%%:*}
    say "== $bin (${t#*:}), t=$(elapsed)s"
    rc=0
    timeout 300 "$BUILD/tests/$bin" --gtest_color=no --gtest_filter="${t#*:}" \
      --gtest_output="xml:$RESULTS_DIR/$bin.xml" 2>&1 | tee -a "$RESULTS" || rc=$?
    say "$bin exit status $rc, t=$(elapsed)s"
    [[ $status != 0 ]] || status=$rc
  done
fi

if [[ $SANITIZE == 1 ]]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck synccheck; do
    say "== compute-sanitizer --tool $tool, t=$(elapsed)s"
    timeout 300 "$SAN" --tool "$tool" --error-exitcode 9 "$BUILD/tests/moe_kernels_test" \
      --gtest_color=no --gtest_filter='*Align*:*Topk*:*Backward*:*Fp32Layer*' 2>&1 |
      tail -25 | tee -a "$RESULTS" || status=$?
  done
fi

say "== bench_moe_kernels, t=$(elapsed)s"
rm -f "$RESULTS_DIR/moe_kernels_bench.jsonl"
timeout 240 "$BUILD/bench/bench_moe_kernels" --iters 20 \
  --json "$RESULTS_DIR/moe_kernels_bench.jsonl" 2>&1 | tee -a "$RESULTS" || {
  rc=$?
  say "bench_moe_kernels exit status $rc"
  [[ $status != 0 ]] || status=$rc
}
say "== bench_paged_decode (B = 1, 64, 256 x L = 512, 4k, 8k), t=$(elapsed)s"
timeout 180 "$BUILD/bench/bench_paged_decode" --device cuda --iters 20 --max_gb 40 2>&1 | tee -a "$RESULTS" || {
  rc=$?
  say "bench_paged_decode exit status $rc"
  [[ $status != 0 ]] || status=$rc
}
say "== done in $(elapsed)s, status $status; results in $RESULTS"
exit "$status"
