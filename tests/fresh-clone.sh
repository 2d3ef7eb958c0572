#!/usr/bin/env bash
# Runs the README's first command verbatim the way a new user does: in a fresh
# clone of HEAD in a temporary directory with nothing beside it. Passes when the
# command exits 0 and the demo says it finished (its last line points at the
# logs it wrote). Sessions go to a temporary folder, not the caller's ~/.dsh.
# CARGO_TARGET_DIR is kept when set, so compiled dependencies are reused.
set -euo pipefail
top=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
# The first fenced block's first command, its trailing comment removed.
first=$(awk '/^```/{n++; next} n==1' "$top/README.md" | sed 's/[[:space:]]#.*$//' | grep -v '^[[:space:]]*$' | head -1)
[ -n "$first" ] || { echo "fresh-clone: README.md has no first command" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q "$top" "$tmp/clone"
echo "== in a fresh clone: $first" >&2
if ! (cd "$tmp/clone" && DSH_SESSIONS_DIR="$tmp/sessions" bash -c "$first") >"$tmp/out" 2>"$tmp/err"; then
  echo "fresh-clone: the README's first command failed:" >&2
  tail -20 "$tmp/err" >&2
  exit 1
fi
if ! grep -q '^Inspect them with' "$tmp/out"; then
  echo "fresh-clone: the demo exited 0 but did not finish; its output:" >&2
  tail -20 "$tmp/out" >&2
  exit 1
fi
echo "fresh-clone: ok ($(grep -c 'child:' "$tmp/out") child logs written)" >&2
