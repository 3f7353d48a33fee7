#!/usr/bin/env bash
# On the GPU machine, as one or more commands of which the check may outlive the first:
#   bench/run_tree_check.sh start WAIT_S PACK_DIR [tree_check.py args...]
#   bench/run_tree_check.sh finish WAIT_S PACK_DIR
# (see bench/run_detached.sh); the pack is PACK_DIR/tree-check.tar.xz.
exec "$(dirname "$0")/run_detached.sh" tree-check bench/tree_check.py "$@"
