#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan; no LibTorch) and runs them on their seed
# corpora (fuzz/corpus/TARGET).
#
#   fuzz/run.sh --smoke                 # what ctest's fuzz_smoke runs: a short, deterministic
#                                       # run of every target (-runs=N -seed=1)
#   fuzz/run.sh --time 600 [TARGET...]  # fuzz each target for 600 s; new inputs are kept in
#                                       # BUILD/corpus/TARGET, crashes in BUILD/artifacts/
#   options: --build DIR (default build-fuzz), --runs N (smoke runs per target)
# A target that crashes, leaks, hits undefined behaviour or breaks one of its checks makes this
# script fail, with libFuzzer's report and the input that did it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzz"
mode=smoke
seconds=0
runs=4000
targets=()
while (($#)); do
  case "$1" in
    --smoke) mode=smoke ;;
    --time) mode=time; seconds="$2"; shift ;;
    --build) build="$2"; shift ;;
    --runs) runs="$2"; shift ;;
    -*) echo "fuzz/run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
((${#targets[@]})) || targets=(safetensors_header_fuzzer checkpoint_index_fuzzer
  tokenizer_json_fuzzer jsonl_fuzzer yaml_config_fuzzer score_request_fuzzer
  generate_request_fuzzer weight_manifest_fuzzer)

cxx="${FUZZ_CXX:-}"
if [ -z "$cxx" ]; then
  for c in clang++-14 clang++; do command -v "$c" >/dev/null && cxx="$c" && break; done
fi
if [ -z "$cxx" ]; then
  echo "fuzz/run.sh: no clang++ found; scripts/setup.sh installs clang-14 and libclang-rt-14-dev" >&2
  exit 1
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root/fuzz" -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
fi
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p "$build/artifacts"
for t in "${targets[@]}"; do
  dict=()
  [ -f "$root/fuzz/dict/$t.dict" ] && dict=(-dict="$root/fuzz/dict/$t.dict")
  common=(-seed=1 -max_len=4096 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
    -artifact_prefix="$build/artifacts/$t-" "${dict[@]}")
  if [ "$mode" = smoke ]; then
    # New inputs go to the first directory: a scratch one, so the seed corpus is only read.
    scratch="$(mktemp -d)"
    log="$build/$t.smoke.log"
    rc=0
    "$build/$t" "${common[@]}" -runs="$runs" "$scratch" "$root/fuzz/corpus/$t" >"$log" 2>&1 ||
      rc=$?
    rm -rf "$scratch"
    if [ "$rc" -ne 0 ]; then
      tail -n 80 "$log"
    else
      echo "== $t: $(grep -E '^Done|^#[0-9]+\s+DONE' "$log" | tail -n 1)"
    fi
  else
    mkdir -p "$build/corpus/$t"
    echo "== $t: $seconds s"
    rc=0
    "$build/$t" "${common[@]}" -max_total_time="$seconds" "$build/corpus/$t" \
      "$root/fuzz/corpus/$t" || rc=$?
  fi
  if [ "$rc" -ne 0 ]; then
    echo "fuzz/run.sh: $t failed (exit $rc); the input is in $build/artifacts/" >&2
    exit 1
  fi
done
echo "fuzz/run.sh: all targets passed"
