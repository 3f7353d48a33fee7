#!/usr/bin/env bash
# On the GPU machine: make SITE, the offline bundle with the built wheel installed over it
# (or the bundle bench/repack_bundle.sh made with the wheel inside, where it was sent), this
# tree's overlay copied over it, and, if UNPATCHED is given, a copy of the same release without
# the series and overlay (the built tree with each patch reversed, checked to mention specprof
# nowhere).
#   bench/gpu_site.sh RELEASE SITE [UNPATCHED]
set -euo pipefail
rel=${1:?usage: bench/gpu_site.sh RELEASE SITE [UNPATCHED]}; site=${2:?SITE}; up=${3:-}
mkdir -p "$site"
if [ -f ".gpu-bundle/site-$rel-wheel.tar.xz" ]; then
  tar -C "$site" -xJf ".gpu-bundle/site-$rel-wheel.tar.xz"
else
  tar -C "$site" -xJf ".gpu-bundle/site-$rel.tar.xz"
  python3 -m pip install -q --no-deps --no-index --target "$site" "dist/sglang-$rel+specprof."*cp312*.whl
fi
cp overlay/sglang/specprof/*.py "$site/sglang/specprof/"
rm -rf "$site/sglang_specprof" && cp -r overlay/sglang_specprof "$site/"
if [ -n "$up" ]; then
  mkdir -p "$up"
  rm -rf "$up/sglang" && cp -r "$site/sglang" "$up/sglang" && rm -rf "$up/sglang/specprof"
  find "$up" -name __pycache__ -prune -exec rm -rf {} +
  repo=$PWD
  tac "patches/sglang-$rel/series" | while read -r p; do (cd "$up" && git apply -R "$repo/patches/sglang-$rel/$p"); done
  if grep -rq --include='*.py' specprof "$up/sglang"; then echo "the unpatched copy still mentions specprof" >&2; exit 1; fi
fi
