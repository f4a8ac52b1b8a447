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
