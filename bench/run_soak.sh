#!/usr/bin/env bash
# On the GPU machine, bench/soak.py in one command or across two (a soak longer than a command
# may run), through bench/run_detached.sh: the bundle patched in place, bench/soak.py started in
# a session of its own so that it outlives the call, then, after WAIT_S seconds (or its end), its
# log, its result, the server logs and the profile (on.jsonl and its rotated copies) packed into
# PACK_DIR/soak.tar.xz:
#   bench/run_soak.sh start WAIT_S PACK_DIR [soak.py args...]
#   bench/run_soak.sh finish WAIT_S PACK_DIR      a later call on the same (still warm) machine:
#                                                 until the soak ends (WAIT_S at most), then the pack
# e.g. the 10-minute soak: bench/run_soak.sh start 540 PACK_DIR, then bench/run_soak.sh finish 540 PACK_DIR
#      in one call:        bench/run_soak.sh start 540 PACK_DIR --seconds 300
# The bundle: .gpu-bundle/site-$SGLANG_RELEASE.tar.xz (0.5.16 by default; one that holds sglang).
exec "$(dirname "$0")/run_detached.sh" soak bench/soak.py "$@"
