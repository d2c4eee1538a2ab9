# shellcheck shell=bash
# The base image of infra/Dockerfile for machines without Docker Hub, sourced by scripts/compose/test.sh:
# Debian bookworm (Python 3.11, like python:3.11-slim) made with mmdebstrap from the machine's own
# apt mirror and `docker import`ed. python3-venv is in the root filesystem, so the image build needs
# no apt. Built once per engine (kept under the tag while the engine's data root is).

BASE_IMAGE=${BASE_IMAGE:-astraflow-base:bookworm}

base_image_build() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image $BASE_IMAGE: present"
    return 0
  fi
  local mirror rootfs t0=$SECONDS
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs="$COMPOSE_STATE/rootfs.tar"
  echo "base image $BASE_IMAGE: mmdebstrap bookworm from $mirror ..."
  mmdebstrap --quiet --variant=minbase --include=ca-certificates,python3,python3-venv \
    --aptopt='Acquire::Check-Valid-Until "false"' bookworm "$rootfs" "$mirror"
  docker import --change 'ENV LANG=C.UTF-8' "$rootfs" "$BASE_IMAGE" >/dev/null
  rm -f "$rootfs"
  echo "base image $BASE_IMAGE: built in $((SECONDS - t0)) s"
}
