#!/usr/bin/env bash
# Rewrites link/symbol-order.txt for the code as it is now (about 5
# minutes): a release build with the linker's map, callgrind traces of it
# (link/trace.sh), the functions they ran (link/order.py), and the release
# build again with the new list. docs/development.md says why.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
DSH_LINK_MAP="$scratch/dsh.map" cargo build --release --bin dsh
link/trace.sh "$target/release/dsh" "$scratch/traces"
link/order.py "$scratch/dsh.map" \
    "$scratch"/traces/callgrind.{w1,w2,w3,demo,run,acp}.* >link/symbol-order.txt
cargo build --release --bin dsh
