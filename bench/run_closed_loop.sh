#!/usr/bin/env bash
# On the GPU machine, as two commands of which the benchmark outlives the first:
#   bench/run_closed_loop.sh start WAIT_S PACK_DIR [closed_loop.py args...]   the bundle patched in
#       place, bench/closed_loop.py started in a session of its own, then after WAIT_S seconds (or
#       its end) its log and what it wrote so far packed into PACK_DIR/closed-loop.tar.xz
#   bench/run_closed_loop.sh finish WAIT_S PACK_DIR                           until it ends (WAIT_S at
#       most), then the pack
# The bundle: .gpu-bundle/site-0.5.16.tar.xz (or any site-RELEASE bundle that holds sglang).
set -uo pipefail
what=${1:?usage: bench/run_closed_loop.sh start|finish WAIT_S PACK_DIR [args...]}; wait_s=${2:?WAIT_S}
pack_dir=${3:?PACK_DIR}; shift 3
root=/tmp/closed-loop
t0=$(date +%s)
pack() {
  mkdir -p "$pack_dir"
  tar -C "$root" -cJf "$pack_dir/closed-loop.tar.xz" --exclude=models --exclude=site out logs bench.log 2>/dev/null
  ls -l "$pack_dir"
}
if [ "$what" = start ]; then
  rm -rf "$root"; mkdir -p "$root/site" "$root/out" "$root/logs"
  bundle=$(ls .gpu-bundle/site-*.tar.xz | head -1)
  tar -C "$root/site" -xJf "$bundle" || exit 1
  python3 build.py -q --sglang "${SGLANG_RELEASE:-0.5.16}" --into "$root/site" || exit 1
  echo "patched in $(( $(date +%s) - t0 )) s"
  PYTHONPATH=$root/site PYTHONUNBUFFERED=1 setsid nohup python3 bench/closed_loop.py --out "$root/out" \
    --logs "$root/logs" "$@" > "$root/bench.log" 2>&1 < /dev/null &
  echo $! > "$root/pid"
fi
pid=$(cat "$root/pid")
while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 5; done
kill -0 "$pid" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "finished"
tail -n 60 "$root/bench.log"
grep -h "Traceback\|Error\|error:" "$root"/logs/server-*.log 2>/dev/null | tail -n 20
pack
