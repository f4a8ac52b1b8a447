#!/usr/bin/env bash
# The test command: set-up (idempotent), configure, build, run every test.
#   ./scripts/test.sh            all tests
#   ./scripts/test.sh -R model   only tests matching a ctest regex
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# ccache keys on paths relative to the checkout, so clones in other folders share one cache.
export CCACHE_BASEDIR="$PWD"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure --timeout 1200 "$@"
