#!/usr/bin/env bash
# Make `docker build` / `docker run` work on a Debian host with no Docker daemon (run as root):
# podman with runc, serving Docker's API on a socket; a Debian bookworm base image built locally
# with debootstrap (cached as a tarball), for registries that cannot be reached.
#
#   eval "$(sudo tools/podman_setup.sh)"   # prints the exports: DOCKER_HOST, EDGE_INFER_BASE_IMAGE
#
# Everything it prints on stdout is shell; progress goes to stderr.
set -euo pipefail

SOCK=/run/podman/podman.sock
BASE_TAG=localhost/edge-infer-base:bookworm
CACHE=${EDGE_INFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edge-infer}/podman
say() { echo "podman-setup: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
    say "must run as root (podman as root is the configuration that works without a daemon)"
    exit 1
fi

need=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
command -v docker >/dev/null || need+=(podman-docker)  # a `docker` that runs podman
# container names resolve on a compose network (deploy/compose.yaml: HAProxy finds its
# replicas by name) only with CNI's dnsname plugin; Debian's podman 4.3 uses CNI
[ -e /usr/lib/cni/dnsname ] || need+=(golang-github-containernetworking-plugin-dnsname)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

mkdir -p /etc/containers
if [ ! -f /etc/containers/containers.conf ] || ! grep -q edge-infer /etc/containers/containers.conf; then
    say "writing /etc/containers/containers.conf (runc, ulimits)"
    cat > /etc/containers/containers.conf <<'CONF'
# written by edge-infer tools/podman_setup.sh
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
CONF
fi

if ! podman image exists "$BASE_TAG"; then
    tarball="$CACHE/bookworm-minbase.tar"
    if [ ! -s "$tarball" ]; then
        say "debootstrap --variant=minbase bookworm (a few minutes; cached in $CACHE)"
        mkdir -p "$CACHE"
        root=$(mktemp -d)
        debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >&2
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$root"
    fi
    say "importing $tarball as $BASE_TAG"
    podman import --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_TAG" >&2
fi

if ! curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; then
    say "starting podman system service on $SOCK"
    mkdir -p "$(dirname "$SOCK")"
    nohup podman system service --time=0 "unix://$SOCK" >/tmp/podman-service.log 2>&1 &
    for _ in $(seq 50); do
        curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1 && break
        sleep 0.2
    done
    curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null || { say "service did not start"; exit 1; }
fi

echo "export DOCKER_HOST=unix://$SOCK"
echo "export EDGE_INFER_BASE_IMAGE=$BASE_TAG"
