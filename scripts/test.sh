#!/usr/bin/env bash
# Runs every test agentgate has, on a fresh machine or a developer's:
#   1. installs redis-server from Debian packages if it is missing, and starts one on a free
#      loopback port (stopped again on exit);
#   2. creates a Python venv in .venv with the official `openai` SDK and pytest, and installs
#      the Codex CLI from npm into .tools/codex (python3-venv and npm from Debian packages if
#      they are missing);
#   3. runs the Rust tests (unit, integration, end-to-end) and the Python SDK tests: every
#      group, whatever failed before it; the script fails if any test did.
# Usage: scripts/test.sh            (from anywhere; it works from the repository root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

log() { printf '\n==> %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    echo "need root to run: $*" >&2; return 1; fi
}

# --- Redis -------------------------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (Debian package)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
redis_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis_dir=$(mktemp -d)
redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no \
  --dir "$redis_dir" --daemonize no >"$redis_dir/redis.log" 2>&1 &
redis_pid=$!
cleanup() { kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; rm -rf "$redis_dir"; }
trap cleanup EXIT
for _ in $(seq 1 100); do
  if redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null 2>&1; then break; fi
  sleep 0.1
done
redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null || { cat "$redis_dir/redis.log"; exit 1; }
export AGENTGATE_TEST_REDIS_URL="redis://127.0.0.1:${redis_port}/0"
log "redis-server on 127.0.0.1:${redis_port}"

# --- Python venv with the official SDK ---------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    log "installing python3-venv (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  log "creating .venv"
  python3 -m venv .venv
fi
log "installing Python test requirements"
.venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt

# --- Codex CLI (from npm), for the client-compatibility test ---------------------------------
if ! command -v npm >/dev/null 2>&1; then
  log "installing npm (Debian package)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
codex_version=0.171.0
if [ ! -x .tools/codex/node_modules/.bin/codex ] || \
   ! grep -q "\"version\": \"$codex_version\"" .tools/codex/node_modules/@openai/codex/package.json 2>/dev/null; then
  log "installing Codex CLI $codex_version (npm)"
  npm install --silent --no-audit --no-fund --prefix .tools/codex "@openai/codex@$codex_version" >/dev/null
fi
export AGENTGATE_CODEX_BIN="$root/.tools/codex/node_modules/.bin/codex"

# --- Rust ---------------------------------------------------------------------------------------
export AGENTGATE_SHARED_DIR="${AGENTGATE_SHARED_DIR:-$root/../shared}"
log "building"
# A one-off build gains nothing from incremental compilation, which would also write gigabytes of
# cache; developers who run this repeatedly can set CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo build --workspace --all-targets --locked
# Every group runs, whatever failed before it, and the script fails if any did.
failed=()
log "Rust tests"
cargo test --workspace --locked --no-fail-fast || failed+=("Rust tests")

# --- Python -------------------------------------------------------------------------------------
log "Python SDK tests"
export AGENTGATE_BIN="$root/target/debug/agentgate"
.venv/bin/python -m pytest tests/python -q || failed+=("Python SDK tests")

if [ "${#failed[@]}" -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "every test passed"
