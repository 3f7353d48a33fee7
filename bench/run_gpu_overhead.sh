#!/usr/bin/env bash
# On the GPU machine: the offline bundle, the built wheel over it, an unpatched copy of the
# same release made by reversing the series (bench/gpu_site.sh), then bench/overhead.py.
#   bench/run_gpu_overhead.sh OUT_DIR [overhead.py args...]
set -euo pipefail
out=${1:?usage: bench/run_gpu_overhead.sh OUT_DIR [overhead.py args...]}; shift
scratch=$(mktemp -d)
bench/gpu_site.sh 0.5.12 "$scratch/patched" "$scratch/upstream"
export PYTHONPATH=$scratch/patched PYTHONUNBUFFERED=1
python3 bench/overhead.py --out "$out" --logs "$out/logs" --upstream-path "$scratch/upstream" "$@"
