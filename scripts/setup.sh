#!/usr/bin/env bash
# One-time (and idempotent) set-up of a fresh Debian machine for building and testing the project:
# Debian packages for the C++ build, and the pinned Python virtual environment in .venv (LibTorch
# comes from its torch wheel). Quiet when there is nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libyaml-cpp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libpcre2-dev libutf8proc-dev python3-venv
  libcurl4-openssl-dev  # rpc/http_teacher.cc: SGLang / vLLM teachers over HTTP
  libgloo-dev  # declarations for c10d's ProcessGroupGloo (the library itself is in libtorch)
  clang-14 libclang-rt-14-dev  # fuzz/: clang's libFuzzer and sanitizer runtimes
)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The virtual environment is rebuilt only when requirements.txt changed since it was made.
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: creating .venv from requirements.txt (first time downloads torch; minutes)"
  PY=${PYTHON:-python3}
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" >"$stamp"
fi
