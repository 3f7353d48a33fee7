#!/usr/bin/env bash
# On the CPU machine: .gpu-bundle/site-RELEASE.tar.xz (built --with-sglang) without what a server
# never loads (test folders, type stubs, the docs, examples, tools, CI and benchmarks of
# flashinfer's CUTLASS and CCCL sources, deep_gemm's FP8 headers, torchao's
# CUTLASS kernels, the libraries' debug sections), recompressed with a large xz dictionary, in place. The 0.5.16 bundle then leaves
# room beside the tree in one sending to the GPU machine (64 MiB): 62 -> 47 MB.
#   bench/trim_bundle.sh RELEASE
set -euo pipefail
rel=${1:?usage: bench/trim_bundle.sh RELEASE}
bundle=".gpu-bundle/site-$rel.tar.xz"
[ -f "$bundle" ] || { echo "no $bundle: build it first (build_site_bundle.py $rel --with-sglang)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$bundle"
find "$tmp" -depth -type d \( -name tests -o -name test \) -not -path '*/sglang/*' -exec rm -rf {} +
find "$tmp" -name '*.pyi' -delete
for d in cccl/ci cccl/docs cccl/examples cccl/benchmarks cccl/python cutlass/examples cutlass/python cutlass/tools \
         cutlass/docs cutlass/test; do rm -rf "$tmp/flashinfer/data/$d"; done
rm -rf "$tmp/deep_gemm/include"  # the headers of its JIT-compiled FP8 GEMMs: a bf16 model compiles none
rm -f "$tmp"/torchao/_C_cutlass_90a*.so  # torchao's FP8/int4 CUTLASS kernels, loaded only where present
# debug sections of the compiled libraries (xgrammar's alone: 53 -> 3 MB); sglang's own files as built
find "$tmp" -name '*.so' -not -path "$tmp/sglang/*" -exec strip --strip-debug {} +
before=$(stat -c %s "$bundle")
(cd "$tmp" && XZ_OPT="--lzma2=preset=9e,dict=192MiB -T2" tar -cJf - .) > "$bundle.part" && mv "$bundle.part" "$bundle"
echo "$bundle: $before -> $(stat -c %s "$bundle") bytes"
