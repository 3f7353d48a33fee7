#!/usr/bin/env bash
# On the GPU machine: the offline bundle with this project's series over it, an unpatched
# copy of the same release, then bench/overhead.py with the unpatched copy as `upstream`.
# A bundle that holds sglang (0.5.16) is patched in place (`build.py --into`) and extracted a
# second time as upstream; one without (0.5.12) takes the built wheel and a copy with every
# patch reversed (bench/gpu_site.sh).
#   bench/run_gpu_overhead.sh RELEASE OUT_DIR [overhead.py args...]
set -euo pipefail
rel=${1:?usage: bench/run_gpu_overhead.sh RELEASE OUT_DIR [overhead.py args...]}; out=${2:?OUT_DIR}; shift 2
scratch=$(mktemp -d)
bundle=.gpu-bundle/site-$rel.tar.xz
mkdir -p "$scratch/patched" "$scratch/upstream"
# the bundle bench/repack_bundle.sh made (the wheel inside) needs no separate site archive
[ -f "$bundle" ] && tar -C "$scratch/patched" -xJf "$bundle"
if [ -f "$scratch/patched/sglang/__init__.py" ] && [ ! -f ".gpu-bundle/site-$rel-wheel.tar.xz" ]; then
  cp -r "$scratch/patched/sglang" "$scratch/upstream/sglang"
  python3 build.py -q --sglang "$rel" --into "$scratch/patched"
else
  rm -rf "$scratch/patched" "$scratch/upstream"
  bench/gpu_site.sh "$rel" "$scratch/patched" "$scratch/upstream"
fi
export PYTHONPATH=$scratch/patched PYTHONUNBUFFERED=1
python3 bench/overhead.py --sglang "$rel" --out "$out" --logs "$out/logs" --upstream-path "$scratch/upstream" "$@"
