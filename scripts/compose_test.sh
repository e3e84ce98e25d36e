#!/usr/bin/env bash
# `make compose-test`: the compose deployment, run for real (tests/integration/deploy/test_compose_stack.py).
#
# First what it needs, installed and started where it can be, idempotently: a container engine
# (Debian's docker.io, and `dockerd` started in the background, logging to $DOCKERD_LOG, when none
# answers) and Compose (the v2 plugin `docker compose` where there is one, else Debian's docker-compose
# 1.29, installed when neither is there; MESHSERVE_COMPOSE="docker-compose" or "docker compose" picks one).
# Where no engine can be had (no root or sudo, no Debian archive, a kernel or sandbox where dockerd
# cannot run) it prints why and exits 0: the test is skipped, not failed. A dockerd it started is
# stopped when it ends (MESHSERVE_KEEP_DOCKERD=1 leaves it running).
# Then the test: base images (real, or stand-ins where no registry answers: deploy/standin/build.sh),
# the image build, the stack up, the checks, `down -v`.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKERD_LOG=${DOCKERD_LOG:-/var/tmp/meshserve-dockerd.log}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo

say() { echo "compose-test: $*"; }
skip() { say "SKIPPED: $*"; exit 0; }

can_install() { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }
apt_install() {
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
  can_install || skip "no container engine, and neither root nor passwordless sudo to install Debian's docker.io"
  say "installing docker.io (Debian package)"
  apt_install docker.io || skip "could not install docker.io from the Debian archive"
fi

started=""
stop_dockerd() {
  if [ -n "$started" ] && [ "${MESHSERVE_KEEP_DOCKERD:-0}" != 1 ]; then
    say "stopping the dockerd it started (pid $started)"
    $SUDO kill -TERM "$started" 2>/dev/null || true
    for _ in $(seq 60); do $SUDO kill -0 "$started" 2>/dev/null || break; sleep 0.5; done
  fi
}
if ! docker info >/dev/null 2>&1; then
  if [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; then
    skip "no engine answers and dockerd needs root (no passwordless sudo)"
  fi
  say "starting dockerd (log: $DOCKERD_LOG)"
  # --group: the socket belongs to the caller's group, so a non-root caller's docker reaches it.
  $SUDO bash -c "dockerd --group $(id -gn) >>'$DOCKERD_LOG' 2>&1 & echo \$!" >/tmp/meshserve-dockerd.pid.$$
  started=$(cat /tmp/meshserve-dockerd.pid.$$) && rm -f /tmp/meshserve-dockerd.pid.$$
  trap stop_dockerd EXIT
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    $SUDO kill -0 "$started" 2>/dev/null || break
    sleep 0.5  # dockerd has no readiness signal of its own but its socket answering
  done
  if ! docker info >/dev/null 2>&1; then
    tail -5 "$DOCKERD_LOG" | sed 's/^/  dockerd: /'
    started_pid=$started; started=""
    $SUDO kill -TERM "$started_pid" 2>/dev/null || true
    skip "dockerd could not be started here (its last log lines above)"
  fi
fi

if [ -z "${MESHSERVE_COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then
    MESHSERVE_COMPOSE="docker compose"
  else
    if ! command -v docker-compose >/dev/null 2>&1; then
      can_install || skip "no Compose, and neither root nor passwordless sudo to install Debian's docker-compose"
      say "installing docker-compose (Debian package)"
      apt_install docker-compose || skip "could not install docker-compose from the Debian archive"
    fi
    MESHSERVE_COMPOSE=docker-compose
  fi
fi
export MESHSERVE_COMPOSE
say "engine $(docker version --format 'client {{.Client.Version}}, server {{.Server.Version}}' 2>/dev/null);" \
  "compose: $MESHSERVE_COMPOSE ($($MESHSERVE_COMPOSE version --short 2>/dev/null || $MESHSERVE_COMPOSE version | head -1))"

MESHSERVE_COMPOSE_TEST=1 .venv/bin/pytest -q -s -p no:cacheprovider tests/integration/deploy/test_compose_stack.py
