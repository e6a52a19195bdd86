#!/usr/bin/env bash
# `make local-image`: the CPU image on a machine that reaches only package registries (no
# container registry), from a fresh clone, as root:
#   1. Debian's podman, buildah, runc and mmdebstrap, where podman is missing;
#   2. /etc/containers/containers.conf, where there is none: cgroupfs and runc (crun refuses a
#      hybrid cgroup layout), and no default ulimits (they can exceed the machine's hard ones);
#   3. the base image from mmdebstrap (`make base-image`), where it is missing;
#   4. `make image` on it, with the host's network and pip's own settings: the folder of
#      PIP_FIND_LINKS (torch's CPU wheel lies there where no torch index is reachable) and the
#      CA bundle of PIP_CERT are mounted into the build, and torch then comes from PyPI's index
#      beside that folder.
# Extra `make image` variables (IMAGE_TAG, IMAGE) pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v podman >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc mmdebstrap
fi
if [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' \
    > /etc/containers/containers.conf
fi
base=localhost/debian-base:bookworm
podman image exists "$base" || make base-image

# pip's own settings where the environment does not set them (a user's or the machine's pip.conf)
pip_setting() { python3 -m pip config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'$/\1/p" | head -1; }
PIP_FIND_LINKS=${PIP_FIND_LINKS:-$(pip_setting find-links)}
PIP_CERT=${PIP_CERT:-$(pip_setting cert)}
flags=(--network=host)
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
  flags+=(-v "$PIP_FIND_LINKS:$PIP_FIND_LINKS:ro" --build-arg "PIP_FIND_LINKS=$PIP_FIND_LINKS"
          --build-arg TORCH_INDEX=https://pypi.org/simple)
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  flags+=(-v "$PIP_CERT:$PIP_CERT:ro" --build-arg "PIP_CERT=$PIP_CERT")
fi
exec make image BASE="$base" IMAGE_BUILD_FLAGS="${flags[*]}" "$@"
