#!/usr/bin/env bash
# Rewrites link/symbol-order.txt for the code as it is now (about 5
# minutes): a release build with the linker's map, callgrind traces of that
# very binary (link/trace.sh), the functions they ran (link/order.py), and
# the release build again with the new list. docs/development.md says why.
set -euo pipefail
shopt -s failglob
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The binary cargo built (wherever its target directory is).
binary() {
    cargo build --release --bin dsh --message-format=json-render-diagnostics |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "dsh":
        print(m["executable"])'
}
bin=$(DSH_LINK_MAP="$scratch/dsh.map" binary)
test -s "$scratch/dsh.map" || { echo "regen.sh: the link wrote no map (see build.rs)" >&2; exit 1; }
link/trace.sh "$bin" "$scratch/traces"
link/order.py "$scratch/dsh.map" \
    "$scratch"/traces/callgrind.{w1,w2,w3,demo,run,acp}.* >"$scratch/order.txt"
test -s "$scratch/order.txt"
mv "$scratch/order.txt" link/symbol-order.txt
cargo build --release --bin dsh
