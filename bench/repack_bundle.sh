#!/usr/bin/env bash
# On the CPU machine: the offline bundle of RELEASE with the built cp312 wheel unpacked into it,
# as one xz archive, .gpu-bundle/site-RELEASE-wheel.tar.xz. The bundle, the wheel and the tree
# are too large together for one sending to the GPU machine (64 MiB); repacked they fit
# (0.5.12: 52 + 8 MB -> 56 MB). bench/gpu_site.sh takes it in place of the bundle and the wheel.
#   bench/repack_bundle.sh RELEASE
set -euo pipefail
rel=${1:?usage: bench/repack_bundle.sh RELEASE}
bundle=".gpu-bundle/site-$rel.tar.xz"
wheel=$(ls dist/sglang-"$rel"+specprof.*-cp312-*.whl 2>/dev/null | head -1)
[ -f "$bundle" ] || { echo "no $bundle: build it first (build_site_bundle.py $rel)" >&2; exit 1; }
[ -n "$wheel" ] || { echo "no cp312 wheel of $rel in dist/: build.py --sglang $rel --python-tag cp312" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$bundle"
python3 -m zipfile -e "$wheel" "$tmp"
out=".gpu-bundle/site-$rel-wheel.tar.xz"
(cd "$tmp" && XZ_OPT="-9e -T2" tar -cJf - .) > "$out.part" && mv "$out.part" "$out"
ls -l "$out"
