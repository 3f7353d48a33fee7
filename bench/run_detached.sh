#!/usr/bin/env bash
# On the GPU machine, a benchmark that may outlive the command that starts it (the machine keeps
# /tmp and its processes between calls while it stays warm), shared by bench/run_closed_loop.sh
# and bench/run_soak.sh:
#   bench/run_detached.sh NAME SCRIPT start WAIT_S PACK_DIR [SCRIPT args...]   the bundle patched in
#       place under /tmp/NAME, SCRIPT started in a session of its own with --out and --logs there,
#       then after WAIT_S seconds (or its end) its log and what it wrote so far packed into
#       PACK_DIR/NAME.tar.xz
#   bench/run_detached.sh NAME SCRIPT finish WAIT_S PACK_DIR                   until it ends (WAIT_S
#       at most), then the pack
# The bundle: .gpu-bundle/site-$SGLANG_RELEASE-wheel.tar.xz (bench/repack_bundle.sh) where sent, else
# .gpu-bundle/site-$SGLANG_RELEASE.tar.xz built --with-sglang, patched --into (0.5.16 by default).
set -uo pipefail
name=${1:?NAME}; script=${2:?SCRIPT}
what=${3:?usage: bench/run_detached.sh NAME SCRIPT start|finish WAIT_S PACK_DIR [args...]}; wait_s=${4:?WAIT_S}
pack_dir=${5:?PACK_DIR}; shift 5
root=/tmp/$name
t0=$(date +%s)
pack() {
  mkdir -p "$pack_dir"
  tar -C "$root" -cJf "$pack_dir/$name.tar.xz" --exclude=models --exclude=site out logs bench.log 2>/dev/null
  ls -l "$pack_dir"
}
if [ "$what" = start ]; then
  if [ -f "$root/pid" ] && kill -0 "$(cat "$root/pid")" 2>/dev/null; then
    echo "$script is still running under $root (pid $(cat "$root/pid")): run finish, or end it first"; exit 1
  fi
  rm -rf "$root"; mkdir -p "$root/site" "$root/out" "$root/logs"
  rel=${SGLANG_RELEASE:-0.5.16}
  if [ -f ".gpu-bundle/site-$rel-wheel.tar.xz" ]; then  # bench/repack_bundle.sh: the built wheel inside
    tar -C "$root/site" -xJf ".gpu-bundle/site-$rel-wheel.tar.xz" || exit 1
    cp overlay/sglang/specprof/*.py "$root/site/sglang/specprof/" && rm -rf "$root/site/sglang_specprof" \
      && cp -r overlay/sglang_specprof "$root/site/" || exit 1
  else
    tar -C "$root/site" -xJf ".gpu-bundle/site-$rel.tar.xz" || exit 1
    python3 build.py -q --sglang "$rel" --into "$root/site" || exit 1
  fi
  echo "patched in $(( $(date +%s) - t0 )) s"
  PYTHONPATH=$root/site PYTHONUNBUFFERED=1 setsid nohup python3 "$script" --out "$root/out" \
    --logs "$root/logs" "$@" > "$root/bench.log" 2>&1 < /dev/null &
  echo $! > "$root/pid"
elif [ ! -f "$root/pid" ]; then
  echo "nothing under $root: this machine is not the one that ran start (it went back between the calls)"
  exit 1
fi
pid=$(cat "$root/pid")
while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 5; done
kill -0 "$pid" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "finished"
tail -n 60 "$root/bench.log"
grep -h "Traceback\|Error\|error:" "$root"/logs/server-*.log 2>/dev/null | tail -n 20
pack
