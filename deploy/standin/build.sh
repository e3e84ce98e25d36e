#!/usr/bin/env bash
# The two public images the compose deployment starts from, where no image registry can be reached.
#
#   deploy/standin/build.sh        # makes sure $MESHSERVE_PYTHON_IMAGE and $MESHSERVE_REDIS_IMAGE exist
#
# For each image (default names: python:3.11-slim-bookworm, redis:7.4-alpine, the ones compose uses):
# pull it; where no registry answers, keep the image already in the local store, or build a stand-in
# from Debian's archive alone and tag it under that name: a Debian bookworm root file system made by
# debootstrap (`docker import`ed as meshserve-standin/debian:bookworm-slim), then python.Dockerfile
# (Debian's Python 3.11 and pip) or redis.Dockerfile (Debian's redis-server, configured as the official
# image is). Stand-ins carry the label org.meshserve.standin. One line per image says which was done.
# Needs root (or sudo) for debootstrap, which it installs from Debian when missing.
# MESHSERVE_STANDIN_PULL=0 skips the pull attempts; MESHSERVE_DEBIAN_MIRROR names another Debian mirror.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

PYTHON_IMAGE=${MESHSERVE_PYTHON_IMAGE:-python:3.11-slim-bookworm}
REDIS_IMAGE=${MESHSERVE_REDIS_IMAGE:-redis:7.4-alpine}
BASE=meshserve-standin/debian:bookworm-slim
MIRROR=${MESHSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo

say() { echo "standin: $*"; }

standin_label() {  # the stand-in label of a local image, "" for another image, "absent" for none
  if docker image inspect "$1" >/dev/null 2>&1; then
    docker image inspect --format '{{index .Config.Labels "org.meshserve.standin"}}' "$1"
  else
    echo absent
  fi
}

base_image() {  # meshserve-standin/debian:bookworm-slim: debootstrap's minimal bookworm, slimmed as the official one is
  [ "$(standin_label "$BASE")" != absent ] && return
  if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap (Debian package)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap >/dev/null
  fi
  root=$(mktemp -d /var/tmp/meshserve-standin.XXXXXX)
  trap '$SUDO rm -rf "$root" "$root.log"' EXIT
  say "debootstrap bookworm (minbase) from $MIRROR"
  $SUDO debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; exit 1; }
  $SUDO tee "$root/etc/apt/sources.list" >/dev/null <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MESHSERVE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
EOF
  # As the official slim images: no documentation, manual pages or translations installed, now or later.
  $SUDO tee "$root/etc/dpkg/dpkg.cfg.d/docker-slim" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  # As the official Debian images: apt keeps no downloaded packages, no package caches, no translations.
  $SUDO tee "$root/etc/apt/apt.conf.d/docker-clean" >/dev/null <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
  $SUDO find "$root/usr/share/doc" -mindepth 2 -not -name copyright -delete 2>/dev/null || true
  $SUDO rm -rf "$root"/usr/share/{man,groff,info,locale,lintian}/* "$root"/var/cache/apt/*.bin \
    "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
  $SUDO tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' \
    --change 'LABEL org.meshserve.standin="debian:bookworm-slim from debootstrap"' - "$BASE" >/dev/null
  $SUDO rm -rf "$root" "$root.log"
}

ensure() {  # NAME DOCKERFILE
  local name=$1 dockerfile=$2 label error
  if [ "${MESHSERVE_STANDIN_PULL:-1}" != 0 ]; then
    if error=$(timeout 600 docker pull -q "$name" 2>&1); then
      say "$name: pulled from its registry (the real image)"
      return
    fi
    error=$(tail -1 <<<"$error")
  else
    error="pulls skipped (MESHSERVE_STANDIN_PULL=0)"
  fi
  label=$(standin_label "$name")
  if [ "$label" = "" ]; then
    say "$name: the image already in the local store (no registry reachable: $error)"
    return
  fi
  if [ "$label" != absent ]; then
    say "$name: the stand-in built earlier ($label; no registry reachable: $error)"
    return
  fi
  base_image
  say "$name: building a stand-in from Debian's packages (no registry reachable: $error)"
  docker build -q -t "$name" --build-arg "BASE=$BASE" -f "$here/$dockerfile" "$here" >/dev/null
  say "$name: stand-in built ($(standin_label "$name"))"
}

ensure "$PYTHON_IMAGE" python.Dockerfile
ensure "$REDIS_IMAGE" redis.Dockerfile
