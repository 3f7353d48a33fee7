#!/usr/bin/env bash
# On the GPU machine, as two commands of which the benchmark outlives the first:
#   bench/run_closed_loop.sh start WAIT_S PACK_DIR [closed_loop.py args...]   the bundle patched in
#       place, bench/closed_loop.py started in a session of its own, then after WAIT_S seconds (or
#       its end) its log and what it wrote so far packed into PACK_DIR/closed-loop.tar.xz
#   bench/run_closed_loop.sh finish WAIT_S PACK_DIR                           until it ends (WAIT_S at
#       most), then the pack
# The bundle: .gpu-bundle/site-$SGLANG_RELEASE.tar.xz (0.5.16 by default; one that holds sglang).
exec "$(dirname "$0")/run_detached.sh" closed-loop bench/closed_loop.py "$@"
