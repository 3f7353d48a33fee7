#!/usr/bin/env bash
# On the GPU machine: this tree's hooks against another tree's (BASE: a folder holding its
# overlay/, e.g. `git archive REF overlay | tar -x -C BASE` on the CPU machine, carried along),
# each tree in a process of its own and the order inside each pair alternating (the second run
# of a pair reads faster on a host that warms up); then each tree's hand-overs timed one by one,
# and what each driver call costs on this host. One archive back: PACK_DIR/hot-path.tar.xz.
#   bench/run_hot_path.sh BASE PACK_DIR [PAIRS (default 4)]
set -uo pipefail
base=${1:?usage: bench/run_hot_path.sh BASE PACK_DIR [PAIRS]}; pack=${2:?PACK_DIR}; pairs=${3:-4}
[ -f "$base/overlay/sglang/specprof/profiler.py" ] || { echo "$base: no overlay/sglang/specprof/profiler.py there"; exit 2; }
w=$(mktemp -d); t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import time;t=time.perf_counter();[None for _ in range(10**6)];print('python loop of 1e6:', round(time.perf_counter()-t,3), 's')"
timeout 120 python3 bench/event_cost.py --n 3000 --reps 3 > "$w/event-cost.json" 2> "$w/event-cost.err"; cat "$w/event-cost.json"
one() {  # TAG TREE BS WAIT_US
  PYTHONPATH=$2 timeout 90 python3 bench/hook_cost.py --cycles 1000 --reps 5 --outputs-thread --wait-kind overlap \
    --phases-every 4 --bs "$3" --wait-us "$4" > "$w/$1.json" 2> "$w/$1.err"
  python3 -c "
import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[2], 'us a cycle', d['added_us_per_cycle'], 'median', d['median_cycle_us']['on'], 'wall added', d['wall_added_us']['on'], 'p99', d['on_p99_us'], d.get('elapsed_symbol'))" "$w/$1.json" "$1" 2>&1 | tail -1
}
for i in $(seq 1 "$pairs"); do
  if [ $((i % 2)) = 1 ]; then one "new-$i" overlay 8 300; one "base-$i" "$base/overlay" 8 300
  else one "base-$i" "$base/overlay" 8 300; one "new-$i" overlay 8 300; fi
done
one new-bs48 overlay 48 300; one base-bs48 "$base/overlay" 48 300
one base-w2000 "$base/overlay" 8 2000; one new-w2000 overlay 8 2000
for t in overlay "$base/overlay" overlay "$base/overlay"; do
  PYTHONPATH=$t timeout 60 python3 bench/hand_overs.py --wait-kind overlap --wait-us 300 \
    | python3 -c "import json, sys; d = json.loads(sys.stdin.read()); d['tree'] = sys.argv[1]; print(json.dumps(d))" "$t" \
    | tee -a "$w/hand-overs.jsonl"
done
echo "done in $(( $(date +%s) - t0 )) s"
mkdir -p "$pack" && tar -C "$w" -cJf "$pack/hot-path.tar.xz" . && ls -l "$pack"
