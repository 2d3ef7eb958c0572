#!/usr/bin/env bash
# Runs a release `dsh` under callgrind on the paths whose code should sit
# together (start-up, the W1/W2/W3 workloads, the demo, `run`, `acp`);
# link/order.py turns the traces into link/symbol-order.txt.
# Usage: link/trace.sh BINARY OUT_DIR (OUT_DIR's old traces are removed)
set -euo pipefail
bin=$(realpath "$1")
out=$(mkdir -p "$2" && realpath "$2")
rm -f "$out"/callgrind.* "$out"/*.log
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# Sessions and settings of the traced runs stay in the scratch directory.
export HOME="$work" DSH_SESSIONS_DIR="$work/sessions"
trace() {
    local name=$1
    shift
    if ! timeout 600 valgrind --tool=callgrind --demangle=no --dump-instr=yes --dump-line=no \
        --trace-children=yes --callgrind-out-file="$out/callgrind.$name.%p" "$bin" "$@" \
        >"$out/$name.log" 2>&1 </dev/null; then
        echo "trace.sh: the $name trace failed; see $out/$name.log" >&2
        exit 1
    fi
}
trace w1 bench w1 --turns 20 --min-seconds 0
trace w2 bench w2 --k 20
trace w3 bench w3 --n 20
trace demo demo
trace run run --demo-model "Write one line about supervision."
trace acp acp --demo-model
