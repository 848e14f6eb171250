#!/usr/bin/env bash
# Installs the system packages the tests use, when missing. Idempotent; needs root (as in CI).
set -euo pipefail
need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
# Podman for --backend containers (Docker's engine does not run on these machines).
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v newuidmap >/dev/null 2>&1 || need+=(uidmap)
command -v fuse-overlayfs >/dev/null 2>&1 || need+=(fuse-overlayfs)
command -v slirp4netns >/dev/null 2>&1 || need+=(slirp4netns)
# The dashboard's browser test drives Debian's chromium (never a downloaded browser).
[ -x /usr/bin/chromium ] || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# What runs Podman here: runc as the runtime (crun is not installed), and no default ulimits
# (raising nofile/nproc inside this sandbox is refused). Only written if absent, so an
# administrator's own configuration wins.
if [ "$(id -u)" = 0 ] && [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  cat > /etc/containers/containers.conf <<'CONF'
# Written by nbdist's scripts/install_system_deps.sh.
[containers]
default_ulimits = []

[engine]
runtime = "runc"
CONF
fi
