#!/usr/bin/env bash
# Prepares, on a GPU machine with no build tools, the binaries that scripts/gpu_payload.sh packed
# on a build machine: no cmake, no Debian packages; only a python3 with the same torch wheel is
# needed (LibTorch and the CUDA libraries come from that wheel, every other library from the
# payload's lib/).
#
#   scripts/gpu/unpack.sh DIR       (scripts/gpu_check.sh --payload DIR runs it first)
#
# DIR holds payload.tar.xz (unpacked into OPD_PAYLOAD_DIR, default /tmp/opd-gpu-payload) or is an
# unpacked payload. Checks that this machine's glibc is new enough and picks the libstdc++ (the
# machine's when it has the newest GLIBCXX the payload needs, else the packed one); recreates the
# absolute paths compiled into the tests (OPD_SOURCE_DIR, OPD_BINARY_DIR with the fixtures,
# OPD_PYTHON: the payload's BAKED) as links to this checkout, the payload and a wrapper of this
# python; writes the payload's gpu_env.sh (the library path of its binaries) for
# scripts/gpu/test.sh and bench.sh. OPD_MAKE_FIXTURES=1 remakes the fixtures here with this
# python (it needs transformers; the packed ones stay where that fails).
#
# Environment: OPD_PYTHON (default python3), OPD_PAYLOAD_DIR; those of scripts/gpu/common.sh.
# shellcheck source=scripts/gpu/common.sh
source "$(dirname "$0")/common.sh"
[[ $# -eq 1 ]] || die "usage: scripts/gpu/unpack.sh DIR"
SRC=$(realpath -m "$1")
gpu_probe
IMAGE_LDP=${LD_LIBRARY_PATH:-}
PY=$(command -v "${OPD_PYTHON:-python3}") || die "no python3 (set OPD_PYTHON)"
"$PY" -c "import torch" >/dev/null 2>&1 || die "$PY cannot import torch"
say "python: $PY, $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')"

P=$(payload_tree "$SRC")
if [[ -f "$SRC/payload.tar.xz" ]]; then
  rm -rf "$P"
  mkdir -p "$P"
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$SRC/payload.tar.xz" "$P" || die "cannot unpack $SRC/payload.tar.xz"
fi
[[ -f "$P/BAKED" && -d "$P/lib" ]] || die "$SRC: no payload (scripts/gpu_payload.sh makes it)"
[[ -f "$P/gpu_tests.txt" ]] || die "$SRC: no gpu_tests.txt (a payload older than the list: pack it again)"
declare -A BAKED=()
while IFS='=' read -r k v; do BAKED[$k]=$v; done <"$P/BAKED"
say "payload: $(tr '\n' ' ' <"$P/BAKED"), unpacked in $(elapsed)s"

# glibc is this machine's: it must be as new as the payload's binaries need.
ver_ge() { [[ "$(printf '%s\n%s\n' "${1#GLIBC*_}" "${2#GLIBC*_}" | sort -V | head -1)" == "${2#GLIBC*_}" ]]; }
GLIBC=$("$PY" -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split()[1])')
ver_ge "$GLIBC" "${BAKED[GLIBC_NEEDED]}" || die "glibc $GLIBC < ${BAKED[GLIBC_NEEDED]} the payload needs"
# libstdc++: this machine's when it has the newest GLIBCXX needed, else the packed one.
IMG_CXX=$( (/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null) | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}' || true)
for c in "$IMG_CXX" /usr/lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6 /lib64/libstdc++.so.6; do
  [[ -n "$c" && -e "$c" ]] && { IMG_CXX=$c; break; }
done
LIBS=$P/lib
if [[ -n "$IMG_CXX" ]] && grep -qa "${BAKED[GLIBCXX_NEEDED]}" "$IMG_CXX"; then
  say "glibc $GLIBC; libstdc++: this machine's $IMG_CXX (has ${BAKED[GLIBCXX_NEEDED]})"
else
  ver_ge "$GLIBC" "${BAKED[GLIBC_NEEDED_CXX]}" ||
    die "this machine's libstdc++ (${IMG_CXX:-none}) lacks ${BAKED[GLIBCXX_NEEDED]}, the packed one needs ${BAKED[GLIBC_NEEDED_CXX]} > glibc $GLIBC"
  LIBS=$P/lib:$P/lib/cxx
  say "glibc $GLIBC; libstdc++: the packed one (this machine's ${IMG_CXX:-none} lacks ${BAKED[GLIBCXX_NEEDED]})"
fi
LDP=$LIBS:$(torch_libs "$PY")

# The tests have the build machine's absolute paths compiled in and no override: recreate them as
# links to this checkout, the payload and a python3 wrapper that runs without the payload's
# libraries.
S=${BAKED[OPD_SOURCE_DIR]} B=${BAKED[OPD_BINARY_DIR]} BP=${BAKED[OPD_PYTHON]}
if [[ "$(realpath -m "$S")" != "$ROOT" ]]; then
  [[ ! -e "$S" || -L "$S" ]] || die "$S exists and is not this checkout: the tests' paths cannot be made"
  mkdir -p "$(dirname "$S")"
  ln -sfn "$ROOT" "$S"
fi
if [[ -L "$B" || ! -e "$B" ]]; then
  mkdir -p "$(dirname "$B")"
  ln -sfn "$P" "$B"
elif [[ "$(realpath "$B")" != "$(realpath "$P")" ]]; then
  die "$B is a folder here: move it away (the tests read the payload through that path)"
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
{
  echo "# written by scripts/gpu/unpack.sh: the environment of this payload's binaries"
  printf 'export LD_LIBRARY_PATH=%q\n' "$LDP"
  printf 'export OPD_PYTHON=%q\n' "$BP"
} >"$P/gpu_env.sh"

if [[ "${OPD_MAKE_FIXTURES:-0}" == 1 ]]; then # remade with this python (transformers)
  for f in fixtures:make_fixtures fixtures_bf16:make_bf16_fixtures fixtures_next:make_next_fixtures \
    fixtures_sft:make_sft_fixtures fixtures_fp8:make_fp8_fixtures; do
    dir=${f%%:*} script=${f#*:}
    rm -rf "$P/$dir.new"
    if timeout "$(limit 120 150)" "$BP" "$ROOT/tests/python/$script.py" --out "$P/$dir.new" \
      >"$OPD_GPU_RESULTS/$script.log" 2>&1; then
      rm -rf "${P:?}/$dir" && mv "$P/$dir.new" "$P/$dir"
      say "$script: remade, t=$(elapsed)s"
    else
      say "$script: failed (log $script.log), the packed fixtures stay, t=$(elapsed)s"
    fi
  done
fi
