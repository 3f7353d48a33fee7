#!/usr/bin/env bash
# On the GPU machine: the offline bundle, the built wheel over it, an unpatched copy of the
# same release made by reversing the series, then bench/overhead.py. Results into $1.
set -euo pipefail
out=${1:?usage: bench/run_gpu_overhead.sh OUT_DIR [overhead.py args...]}; shift
scratch=$(mktemp -d); site=$scratch/patched; up=$scratch/upstream
mkdir -p "$site" "$up"
tar -C "$site" -xJf .gpu-bundle/site-0.5.12.tar.xz
python3 -m pip install -q --no-deps --no-index --target "$site" dist/sglang-*.whl
rm -rf "$up/sglang" && cp -r "$site/sglang" "$up/sglang" && rm -rf "$up/sglang/specprof"
find "$up" -name __pycache__ -prune -exec rm -rf {} +
repo=$PWD
tac patches/sglang-0.5.12/series | while read -r p; do (cd "$up" && git apply -R "$repo/patches/sglang-0.5.12/$p"); done
if grep -rq --include='*.py' specprof "$up/sglang"; then echo "the unpatched copy still mentions specprof" >&2; exit 1; fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1
python3 bench/overhead.py --out "$out" --logs "$out/logs" --upstream-path "$up" "$@"
