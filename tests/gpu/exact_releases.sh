#!/bin/bash
# tests/gpu/exact_check.py for several SGLang releases at once on one GPU, each in its own site.
#
#   WHEELS=DIR [RESULTS=DIR] [ARCHIVE=FILE.tar.xz] tests/gpu/exact_releases.sh X:SITE[:SERVER,SERVER...] ...
#
# SITE: a folder with the release's offline bundle unpacked (../shared/gpu/build_site_bundle.py X);
# WHEELS/sglang-X+specprof*.whl (default WHEELS: dist) is installed into it with --no-deps. Default server: s3k1.
# Each release's servers start once the previous release's last server holds its KV pool (every
# server sizes itself by what is free), so the loads of all releases overlap on the GPU: the
# counts are exact regardless, the rates and the partition read a shared GPU.
# Results: RESULTS/X/ (check.json, profiles, logs; default RESULTS: exact-releases), packed into ARCHIVE if given.
WHEELS=${WHEELS:-dist}
R=$(realpath -m "${RESULTS:-exact-releases}"); rm -rf "$R"; mkdir -p "$R"
trap '[ -n "$ARCHIVE" ] && tar -C "$(dirname "$R")" -cJf "$ARCHIVE" "$(basename "$R")"' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv > "$R"/gpu.txt
i=0; pids=()
for spec in "$@"; do
  v=${spec%%:*}; rest=${spec#*:}; site=${rest%%:*}; srv=s3k1; [ "$rest" != "$site" ] && srv=${rest#*:}
  python3 -m pip install -q --no-deps --no-index --target $site $WHEELS/sglang-$v+specprof*.whl > "$R"/pip-$v.log 2>&1 || { echo "pip $v failed"; continue; }
  PYTHONPATH=$site:overlay:$site/nvidia_cutlass_dsl/python_packages python3 -c "import sglang, importlib.metadata as m; print(m.version('sglang'), sglang.__file__)" > "$R"/ver-$v.txt 2>&1
  pp=$site:overlay; [ -d $site/nvidia_cutlass_dsl/python_packages ] && pp=$pp:$site/nvidia_cutlass_dsl/python_packages
  port=$((31000 + 20*i))
  ( PYTHONPATH=$pp timeout 540 python3 tests/gpu/exact_check.py --out $R/$v --servers ${srv//,/ } --quick --warm-each --first-port $port > "$R"/run-$v.log 2>&1; echo "rc $?" >> "$R"/run-$v.log ) &
  pids+=($!)
  # the next server starts once this one holds its KV pool (each sizes itself by what is free)
  for t in $(seq 1 300); do grep -qs "Memory pool end" $R/$v/logs/server-${srv##*,}.log && break; grep -qs "^rc " $R/run-$v.log && break; sleep 1; done
  echo "$v started at $SECONDS s" >> "$R"/order.txt
  i=$((i+1))
done
wait "${pids[@]}"
for spec in "$@"; do v=${spec%%:*}; echo "== $v"; tail -3 $R/run-$v.log; done
rm -rf $R/*/models
