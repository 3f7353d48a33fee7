#!/usr/bin/env bash
# On the GPU machine, in two calls that follow each other while the machine is warm:
#   bench/run_closed_loop.sh start WAIT_S [closed_loop.py args...]   the bundle patched in place,
#       bench/closed_loop.py started in a session of its own (it outlives the call), then
#       WAIT_S seconds of its log and what it wrote so far packed into $OUT/closed-loop.tar.xz
#   bench/run_closed_loop.sh finish WAIT_S                           until it ends (WAIT_S at most), then the pack
# The bundle: .gpu-bundle/site-0.5.16.tar.xz (or any site-RELEASE bundle that holds sglang).
set -uo pipefail
what=${1:?usage: bench/run_closed_loop.sh start|finish WAIT_S [args...]}; wait_s=${2:?WAIT_S}; shift 2
root=/tmp/closed-loop
t0=$(date +%s)
pack() {
  tar -C "$root" -cJf "$OUT/closed-loop.tar.xz" --exclude=models --exclude=site out logs bench.log 2>/dev/null
  ls -l "$OUT"
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
