#!/usr/bin/env bash
# On the GPU machine: the offline bundle patched in place (build.py --into), then
# tests/gpu/exact_check.py with the given arguments, its result, profiles and server logs packed
# into PACK_DIR/exact-check.tar.xz (one file back), whatever the check's exit.
#   bench/run_exact_check.sh WAIT_S PACK_DIR [exact_check.py args...]
# e.g. bench/run_exact_check.sh 480 OUT --servers df8 dp8 --quick --kernels 2 --cost-rounds 10 --cost-tokens 384
# WAIT_S bounds the check (it is stopped after that many seconds, the pack still made).
# The bundle: .gpu-bundle/site-$SGLANG_RELEASE.tar.xz built --with-sglang (0.5.16 by default).
set -uo pipefail
wait_s=${1:?usage: bench/run_exact_check.sh WAIT_S PACK_DIR [exact_check.py args...]}; pack_dir=${2:?PACK_DIR}; shift 2
root=/tmp/exact-check
t0=$(date +%s)
rm -rf "$root"; mkdir -p "$root/site" "$root/out" "$root/logs"
rel=${SGLANG_RELEASE:-0.5.16}
tar -C "$root/site" -xJf ".gpu-bundle/site-$rel.tar.xz" && python3 build.py -q --sglang "$rel" --into "$root/site" \
  || { echo "the bundle could not be patched"; exit 1; }
echo "patched in $(( $(date +%s) - t0 )) s"
PYTHONPATH=$root/site PYTHONUNBUFFERED=1 timeout "$wait_s" python3 tests/gpu/exact_check.py --out "$root/out" \
  --logs "$root/logs" "$@" > "$root/check.log" 2>&1
echo "exit $? after $(( $(date +%s) - t0 )) s"
grep -v chunks_ms "$root/check.log" | tail -n 40
grep -h "Traceback\|Error\|error:" "$root"/logs/server-*.log 2>/dev/null | tail -n 20
mkdir -p "$pack_dir"
tar -C "$root" -cJf "$pack_dir/exact-check.tar.xz" --exclude=models out logs check.log
ls -l "$pack_dir"
