#!/usr/bin/env bash
# Assembles gpu_payload/payload.tar.xz (gpu_payload/ is git-ignored; copy it to the GPU machine)
# from the main build, for a GPU machine that has python3 with the same torch wheel (2.11,
# CUDA 13) but none of our Debian libraries and no build tools. The tree (staged in
# BUILD/gpu_payload_stage) holds the GPU test binaries (BUILD/gpu_tests.txt, which cmake writes
# from tests/CMakeLists.txt's lm_test_gpu, is packed with them), the GPU benchmarks and the
# servers the GPU cases spawn, stripped, laid out as the build tree is (tests/, bench/,
# teacher_service/, rollout/, ctl/, trainer/), plus
#   lib/        every shared library they need per ldd, except LibTorch's own and the CUDA
#               libraries of the wheel's nvidia-* packages (the image has them: found at run
#               time under torch/lib and site-packages/nvidia/*/lib) and the glibc core (libc,
#               libm, libdl, libpthread, librt, libutil, libresolv, ld-linux: never carried, a
#               glibc must match its own loader).
#   lib/cxx/    libstdc++ and libgcc_s, carried apart: this one needs GLIBC_2.36, so
#               scripts/gpu/unpack.sh uses the GPU machine's libstdc++ when it has the newest
#               GLIBCXX the payload needs (GLIBCXX_NEEDED) and these only when it does not.
#   BAKED       the absolute paths compiled into the tests (OPD_SOURCE_DIR, OPD_BINARY_DIR,
#               OPD_PYTHON; the fixtures dirs lie in OPD_BINARY_DIR), which scripts/gpu/unpack.sh
#               recreates on the GPU machine as links.
#   fixtures*/  the fixtures the GPU cases read, made here by tests/python/make_*_fixtures.py (the
#               GPU machine's python3 may lack transformers); scripts/gpu/unpack.sh can remake
#               them there with OPD_MAKE_FIXTURES=1.
# The binaries' RUNPATH names this machine's .venv: they find LibTorch through LD_LIBRARY_PATH
# instead (searched first), set by scripts/gpu/unpack.sh.
#
#   scripts/gpu_payload.sh [--out DIR]           assemble (default DIR: gpu_payload), then check
#   scripts/gpu_payload.sh --build ...           first rebuilds the payload's targets in BUILD
#                                                (under the build lock, -j2), so that they agree
#   scripts/gpu_payload.sh --check [--out DIR]   check DIR/payload.tar.xz (assembles it if absent;
#                                                with --if-present: exit 77, skipped, if absent)
# Assembling takes ~2 min here (xz of ~110 MB on 2 cores), the check ~25 s.
#
# The check (also ctest gpu_payload_check): under env -i with LD_LIBRARY_PATH = lib + lib/cxx + this
# python's torch/lib + nvidia/*/lib only, ldd finds every library of every payload binary, none
# from /usr or /lib other than the glibc core; every test of its gpu_tests.txt is there and lists
# its tests, the benchmarks and servers start. Exit 1 on any failure, or when the payload exceeds
# OPD_PAYLOAD_LIMIT_MIB (default 64: a payload kept small to copy; ~27 MB when this was written).
# Environment: OPD_BUILD_DIR (default build), OPD_PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${OPD_BUILD_DIR:-$ROOT/build}
PY=${OPD_PYTHON:-$ROOT/.venv/bin/python}
OUTDIR=$ROOT/gpu_payload
STAGE=$BUILD/gpu_payload_stage
CHECK_ONLY=0 IF_PRESENT=0 REBUILD=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) CHECK_ONLY=1 ;;
    --if-present) IF_PRESENT=1 ;;
    --build) REBUILD=1 ;;
    --out) OUTDIR=$(realpath -m "$2"); shift ;;
    *) echo "usage: scripts/gpu_payload.sh [--build] [--check [--if-present]] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
LIMIT=$((${OPD_PAYLOAD_LIMIT_MIB:-64} * 1024 * 1024))
die() { echo "gpu_payload: $*" >&2; exit 1; }

HELPERS=(tests/load_rss_probe teacher_service/opd-teacher rollout/opd-rollout ctl/opd-ctl
  trainer/opd-trainer)
BENCHES=(bench/bench_moe_kernels bench/bench_paged_decode)
FIXTURES=(fixtures fixtures_bf16 fixtures_next fixtures_sft fixtures_fp8)
GLIBC_CORE='^(libc|libm|libdl|libpthread|librt|libutil|libresolv|libmvec|ld-linux-x86-64|linux-vdso)\.so'

# The torch wheel's library dirs: torch/lib and site-packages/nvidia/*/lib.
TORCH_LIBS=$("$PY" -c 'import torch, os, glob
d = os.path.dirname(torch.__file__)
print(":".join([d + "/lib"] + sorted(glob.glob(os.path.join(os.path.dirname(d), "nvidia", "*", "lib")))))') ||
  die "$PY cannot import torch (set OPD_PYTHON)"

payload_bins() {  # the executables of tree $1
  local f
  for f in "$1"/tests/* "$1"/bench/* "$1"/teacher_service/* "$1"/rollout/* "$1"/ctl/* "$1"/trainer/*; do
    [[ -f "$f" && -x "$f" ]] && echo "$f"
  done
}
in_torch() {  # path under one of TORCH_LIBS?
  local d
  IFS=: read -ra dirs <<<"$TORCH_LIBS"
  for d in "${dirs[@]}"; do [[ "$1" == "$d"/* || "$(realpath "$1")" == "$(realpath "$d")"/* ]] && return 0; done
  return 1
}
newest() {  # newest symbol version matching $1 that the given files need
  local pat=$1 f
  shift
  for f in "$@"; do objdump -T "$f" 2>/dev/null | grep -o "${pat}[0-9.]*" || true; done | sort -uV | tail -1
}

gpu_tests() {  # the names in gpu_tests.txt $1
  [[ -f "$1" ]] || die "$1 missing (cmake writes it when it configures the build)"
  awk '!/^#/ && NF {print $1}' "$1"
}

assemble() {
  local T=$STAGE
  rm -rf "$T"
  mkdir -p "$T"/{tests,bench,teacher_service,rollout,ctl,trainer,lib/cxx}
  local rels=() t tests
  mapfile -t tests < <(gpu_tests "$BUILD/gpu_tests.txt")
  for t in "${tests[@]}"; do rels+=("tests/$t"); done
  rels+=("${HELPERS[@]}" "${BENCHES[@]}")
  for t in "${rels[@]}"; do [[ -x "$BUILD/$t" ]] || die "$BUILD/$t not built"; done
  # Under the build lock: a target being relinked is never copied half-written.
  # shellcheck disable=SC2016 # the inner shell expands them
  flock -w 900 /tmp/opd-build.lock bash -c 'for t in "${@:3}"; do cp "$1/$t" "$2/$t"; done' _ \
    "$BUILD" "$T" "${rels[@]}"
  for t in "${rels[@]}"; do strip --strip-unneeded "$T/$t"; done
  cp "$BUILD/gpu_tests.txt" "$T/gpu_tests.txt"
  for t in "${FIXTURES[@]}"; do
    [[ -d "$BUILD/$t" ]] || die "$BUILD/$t missing (ctest -R make_ in $BUILD)"
    cp -r "$BUILD/$t" "$T/$t"
  done
  # Every library ldd resolves outside the torch wheel and the glibc core.
  local name path dest
  while read -r name path; do
    [[ "$name" =~ $GLIBC_CORE ]] && continue
    in_torch "$path" && continue
    dest=$T/lib
    [[ "$name" == libstdc++.so.* || "$name" == libgcc_s.so.* ]] && dest=$T/lib/cxx
    [[ -e "$dest/$name" ]] || cp -L "$path" "$dest/$name"
  done < <(for b in $(payload_bins "$T"); do
    env -i LD_LIBRARY_PATH="$TORCH_LIBS" ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
  done | sort -u)
  local bins
  mapfile -t bins < <(payload_bins "$T")
  {
    echo "OPD_SOURCE_DIR=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")"
    echo "OPD_BINARY_DIR=$(cd "$BUILD" && pwd -P)"
    echo "OPD_PYTHON=$(sed -n 's/^OPD_PYTHON:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
    echo "GLIBC_NEEDED=$(newest GLIBC_ "${bins[@]}" "$T"/lib/*.so*)"
    echo "GLIBC_NEEDED_CXX=$(newest GLIBC_ "$T"/lib/cxx/*)"
    echo "GLIBCXX_NEEDED=$(newest GLIBCXX_ "${bins[@]}" "$T"/lib/*.so*)"
    echo "BUILT_FROM=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ)"
    echo "TORCH=$("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  } >"$T/BAKED"
  rm -rf "$OUTDIR"
  mkdir -p "$OUTDIR"
  tar -C "$T" -cf - . | xz -6 -T2 >"$OUTDIR/payload.tar.xz"
  cp "$T/BAKED" "$OUTDIR/BAKED"
  echo "gpu_payload: assembled $OUTDIR/payload.tar.xz from $BUILD ($(du -sh "$T" | cut -f1) unpacked)"
}

check() {
  local fail=0 b out bad size T
  [[ -f "$OUTDIR/payload.tar.xz" ]] || die "$OUTDIR/payload.tar.xz missing"
  size=$(du -sb "$OUTDIR" | cut -f1)
  echo "gpu_payload: $OUTDIR: $((size / 1024 / 1024)) MiB ($size bytes; limit $LIMIT)"
  if ((size > LIMIT)); then
    echo "gpu_payload: over $((LIMIT / 1024 / 1024)) MiB; largest files in the tree:" >&2
    find "$STAGE" -type f -printf '%s %p\n' 2>/dev/null | sort -rn | head -15 >&2
    fail=1
  fi
  T=$(mktemp -d /tmp/opd-payload-check.XXXXXX)
  CHECK_TMP=$T
  trap 'rm -rf "$CHECK_TMP"' EXIT
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$OUTDIR/payload.tar.xz" "$T"
  echo "gpu_payload: unpacked $(du -sh "$T" | cut -f1): $(payload_bins "$T" | wc -l) binaries," \
    "$(find "$T/lib" -maxdepth 1 -name '*.so*' | wc -l) libraries + $(find "$T/lib/cxx" -type f | wc -l) in lib/cxx"
  if [[ -f "$T/gpu_tests.txt" ]]; then
    local t
    for t in $(gpu_tests "$T/gpu_tests.txt"); do
      [[ -x "$T/tests/$t" ]] || { echo "FAIL tests/$t (gpu_tests.txt) is not in the payload"; fail=1; }
    done
  else
    echo "FAIL gpu_tests.txt is not in the payload (assemble it again)"; fail=1
  fi
  local LDP="$T/lib:$T/lib/cxx:$TORCH_LIBS"
  for b in $(payload_bins "$T"); do
    out=$(env -i LD_LIBRARY_PATH="$LDP" ldd "$b" 2>&1) || { echo "FAIL ldd $b: $out"; fail=1; continue; }
    bad=$(echo "$out" | awk '$2 == "=>" {print $1, $3}' | while read -r name path; do
      if [[ "$path" == "not" ]]; then echo "$name not found"
      elif [[ "$path" == "$T/lib/"* || "$name" =~ $GLIBC_CORE ]]; then :
      elif in_torch "$path"; then :
      else echo "$name from $path"; fi
    done)
    if [[ -n "$bad" ]]; then echo "FAIL ldd ${b#"$T"/}: $bad"; fail=1; fi
  done
  # Each binary starts under that environment alone (no GPU needed: listing, usage, no-GPU skip).
  local ENV=(env -i LD_LIBRARY_PATH="$LDP" PATH=/usr/bin:/bin HOME=/tmp)
  for b in $(payload_bins "$T"); do
    local rel=${b#"$T"/} rc=0 args
    case "$rel" in
      tests/load_rss_probe) args=(--bogus-flag) ;;  # usage, exit 2: it started
      tests/*) args=(--gtest_list_tests) ;;
      bench/bench_paged_decode) args=(--device cuda --iters 1 --max_gb 0) ;;  # no GPU: returns
      bench/bench_moe_kernels) args=(--bogus-flag) ;;
      *) args=(--help) ;;
    esac
    out=$(timeout 60 "${ENV[@]}" "$b" "${args[@]}" 2>&1) || rc=$?
    if [[ "$rel" == tests/*_test ]]; then
      if [[ $rc != 0 ]] || ! grep -q '^  ' <<<"$out"; then
        echo "FAIL $rel --gtest_list_tests (rc $rc): $(tail -3 <<<"$out")"; fail=1
      else
        echo "ok   $rel lists $(grep -c '^  ' <<<"$out") tests"
      fi
    elif [[ $rc -ge 126 ]] || grep -q 'error while loading shared libraries\|symbol lookup error\|version .* not found' <<<"$out"; then
      echo "FAIL $rel ${args[*]} (rc $rc): $(tail -3 <<<"$out")"; fail=1
    else
      echo "ok   $rel starts (${args[*]}: rc $rc)"
    fi
  done
  grep -E '^(GLIBC|TORCH)' "$T/BAKED" | tr '\n' ' '
  echo
  [[ $fail == 0 ]] && echo "gpu_payload: check passed" || echo "gpu_payload: check FAILED"
  return $fail
}

if [[ $CHECK_ONLY == 1 && $IF_PRESENT == 1 && ! -f "$OUTDIR/payload.tar.xz" ]]; then
  echo "gpu_payload: no $OUTDIR/payload.tar.xz (scripts/gpu_payload.sh makes it): skipped"
  exit 77
fi
if [[ $REBUILD == 1 ]]; then
  mapfile -t targets < <(gpu_tests "$BUILD/gpu_tests.txt")
  for t in "${HELPERS[@]}" "${BENCHES[@]}"; do targets+=("${t##*/}"); done
  flock /tmp/opd-build.lock cmake --build "$BUILD" --target "${targets[@]}" -j2 || die "build failed"
fi
if [[ $CHECK_ONLY == 0 || ! -f "$OUTDIR/payload.tar.xz" ]]; then assemble; fi
check
