#!/usr/bin/env bash
# On the GPU machine, as two or more commands of which the sweep outlives the first:
#   bench/run_advisor_sweep.sh start WAIT_S PACK_DIR [advisor_sweep.py args...]
#   bench/run_advisor_sweep.sh finish WAIT_S PACK_DIR
# (see bench/run_detached.sh); the pack is PACK_DIR/advisor-sweep.tar.xz.
exec "$(dirname "$0")/run_detached.sh" advisor-sweep bench/advisor_sweep.py "$@"
