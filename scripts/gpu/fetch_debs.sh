#!/usr/bin/env bash
# On a Debian 12 x86-64 machine with apt: downloads into .gpu_debs/ (git-ignored) the Debian
# packages lm builds against, for a GPU machine that lacks them and has no package registry.
# Copy .gpu_debs/ with the checkout to the GPU machine: scripts/gpu/build.sh unpacks them into a
# private prefix (never into /) and builds against it.
#
#   scripts/gpu/fetch_debs.sh        (scripts/gpu_check.sh --fetch-debs runs it)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEBS=(libabsl-dev libabsl20220623 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  nlohmann-json3-dev libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libgtest-dev
  pkgconf pkgconf-bin libpkgconf3)
die() {
  echo "gpu_check: $*" >&2
  exit 1
}
command -v apt-get >/dev/null || die "--fetch-debs needs apt-get (a Debian/Ubuntu machine)"
[[ "$(uname -m)" == "x86_64" ]] || die "--fetch-debs: run it on x86-64 (as the GPU machine is)"
mkdir -p .gpu_debs
# apt names files with '%3a' for an epoch's ':'; keep only portable characters.
(cd .gpu_debs && apt-get download "${DEBS[@]}" &&
  for f in *.deb; do [[ "$f" == "${f//[^A-Za-z0-9._-]/_}" ]] || mv "$f" "${f//[^A-Za-z0-9._-]/_}"; done)
du -sh .gpu_debs
echo "gpu_check: copy .gpu_debs/ with the checkout to the GPU machine and run scripts/gpu_check.sh there"
