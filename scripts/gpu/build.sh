#!/usr/bin/env bash
# Configures and builds, on a GPU machine, the GPU tests of tests/CMakeLists.txt (those declared
# with lm_test_gpu: the build's gpu_tests.txt), the GPU benchmarks and what they start, then makes
# the fixtures they read. By default the kernels-only configuration (-DOPD_KERNELS_ONLY=ON: lm,
# kernels/ and their tests, no gRPC), a few minutes on 16 cores; OPD_GPU_FULL_BUILD=1 configures
# the full build (needs gRPC & co.), whose list adds the learner's, the engine's, the sampler's,
# Qwen3-Next's and the weight pushes' GPU cases and the bf16 opd-teacher on the GPU.
#
#   scripts/gpu/build.sh            (scripts/gpu_check.sh runs it first)
#
# Debian packages copied along in .gpu_debs/ (scripts/gpu/fetch_debs.sh) are unpacked into a
# private prefix and built against; the tree's gpu_env.sh then puts their libraries on the
# library path of scripts/gpu/test.sh and bench.sh.
#
# Environment: OPD_BUILD_DIR (default build-gpu), OPD_GPU_FULL_BUILD, OPD_PYTHON (a python whose
# torch is the LibTorch to build against), OPD_CUDA_ARCHITECTURES (default "80;90a": A100 and
# H100/H200), OPD_JOBS (default: all cores), CUDACXX (default: nvcc on PATH or
# /usr/local/cuda/bin/nvcc); those of scripts/gpu/common.sh.
# shellcheck source=scripts/gpu/common.sh
source "$(dirname "$0")/common.sh"
[[ $# -eq 0 ]] || die "usage: scripts/gpu/build.sh (no arguments; see its header)"
BUILD=${OPD_BUILD_DIR:-$ROOT/build-gpu}
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
gpu_probe

find_python "$ROOT/.venv/bin/python" python3
say "python: $PY, $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')"
if [[ -z "${CUDACXX:-}" ]]; then
  if command -v nvcc >/dev/null; then
    CUDACXX=$(command -v nvcc)
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDACXX=/usr/local/cuda/bin/nvcc
  else
    die "nvcc not found (set CUDACXX)"
  fi
  export CUDACXX
fi
say "nvcc: $CUDACXX ($("$CUDACXX" --version | tail -1))"
command -v cmake >/dev/null || die "cmake not found"
command -v ninja >/dev/null || die "ninja not found"

# The Debian packages of .gpu_debs/, unpacked into a private prefix.
CMAKE_EXTRA=()
ENV_LDP=""
if compgen -G "$ROOT/.gpu_debs/*.deb" >/dev/null; then
  DEPS=$BUILD/gpu_deps
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  for deb in "$ROOT"/.gpu_debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$DEPS"
    else # a .deb is an ar archive holding data.tar.*
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
  ENV_LDP=$LIBDIR
  command -v pkg-config >/dev/null || CMAKE_EXTRA+=("-DPKG_CONFIG_EXECUTABLE=$DEPS/usr/bin/pkgconf")
  say "unpacked $(compgen -G "$ROOT/.gpu_debs/*.deb" | wc -l) packages of .gpu_debs into $DEPS"
fi
{
  echo "# written by scripts/gpu/build.sh: the environment of this tree's GPU tests"
  # shellcheck disable=SC2016 # expanded where the file is sourced
  [[ -z "$ENV_LDP" ]] || printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$ENV_LDP"
  printf 'export OPD_PYTHON=%q\n' "$PY"
} >"$BUILD/gpu_env.sh"

KERNELS_ONLY=ON
EXTRA_TARGETS=()
if [[ "${OPD_GPU_FULL_BUILD:-0}" == 1 ]]; then
  KERNELS_ONLY=OFF
  EXTRA_TARGETS=(opd-teacher opd-rollout opd-ctl) # the servers the GPU cases start
fi
JOBS=${OPD_JOBS:-$(nproc)}
t0=$(elapsed)
say "== configure (OPD_KERNELS_ONLY=$KERNELS_ONLY) + build (jobs $JOBS) in $BUILD, t=${t0}s"
timeout 300 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DOPD_KERNELS_ONLY=$KERNELS_ONLY -DOPD_PYTHON="$PY" \
  -DOPD_CUDA_ARCHITECTURES="${OPD_CUDA_ARCHITECTURES:-80;90a}" "${CMAKE_EXTRA[@]}" \
  >"$BUILD/configure.log" 2>&1 || {
  tail -40 "$BUILD/configure.log" | tee -a "$RESULTS"
  die "configure failed (log: $BUILD/configure.log; missing packages? see scripts/gpu/fetch_debs.sh)"
}
# The GPU tests this configuration declares (their dependencies come with them) and the
# benchmarks; bench_moe_kernels exists where nvcc does.
mapfile -t TESTS < <(awk '!/^#/ && NF {print $1}' "$BUILD/gpu_tests.txt")
[[ ${#TESTS[@]} -gt 0 ]] || die "$BUILD/gpu_tests.txt lists no tests"
BENCHES=(bench_paged_decode)
grep -qx moe_kernels_test < <(printf '%s\n' "${TESTS[@]}") && BENCHES+=(bench_moe_kernels)
timeout 600 cmake --build "$BUILD" -j "$JOBS" --target "${TESTS[@]}" "${BENCHES[@]}" \
  "${EXTRA_TARGETS[@]}" >"$BUILD/build.log" 2>&1 || {
  tail -60 "$BUILD/build.log" | tee -a "$RESULTS"
  die "build failed (log: $BUILD/build.log)"
}
say "built ${TESTS[*]} ${BENCHES[*]} ${EXTRA_TARGETS[*]} in $(($(elapsed) - t0))s"

# The fixtures (tests/python/make_*_fixtures.py: tiny models saved by transformers and its
# outputs). A set that cannot be made (no transformers in this python) leaves its cases out of
# scripts/gpu/test.sh's run (it says which).
FIXTURES=(fixtures_bf16:make_bf16_fixtures fixtures_fp8:make_fp8_fixtures)
if [[ "${OPD_GPU_FULL_BUILD:-0}" == 1 ]]; then
  FIXTURES+=(fixtures:make_fixtures fixtures_next:make_next_fixtures fixtures_sft:make_sft_fixtures)
fi
for f in "${FIXTURES[@]}"; do
  dir=${f%%:*} script=${f#*:}
  rm -rf "${BUILD:?}/$dir"
  if timeout 600 "$PY" "$ROOT/tests/python/$script.py" --out "$BUILD/$dir" >"$BUILD/$script.log" 2>&1; then
    say "$script: made, t=$(elapsed)s"
  else
    rm -rf "${BUILD:?}/$dir"
    say "$script: failed (no transformers in $PY? log: $BUILD/$script.log)"
  fi
done
