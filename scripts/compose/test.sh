#!/usr/bin/env bash
# `make test-compose`: the compose stack built and run for real, with no image from Docker Hub.
#   1. a Docker engine: Debian's docker.io started by hand on a socket of its own (scripts/compose/engine.sh),
#      or the one that already answers;
#   2. the base image from Debian's mirror (mmdebstrap + docker import: scripts/compose/base-image.sh);
#   3. the project's image (infra/Dockerfile) with the host's CA bundle and local wheels (build-host.sh);
#   4. tests/test_compose.py with ASTRAFLOW_COMPOSE_LIVE=1: a run of the math recipe in
#      infra/docker-compose.tansu-seaweedfs.yml, scaled, killed, stopped, resumed, read from the host;
#      then a short run of its secured variant (infra/docker-compose.secure.yml), whose node container
#      is refused every write to the weights and checkpoints.
# The engine it started is stopped by its PID whatever happens (trap); the test removes its containers,
# network and volumes. Images and pip's cache stay in the engine's data root for the next run.
# Skips (exit 0, one line) only where no engine can be had: not root, or neither docker nor apt-get.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/compose
# shellcheck source=engine.sh
source "$here/engine.sh"
# shellcheck source=base-image.sh
source "$here/base-image.sh"
# shellcheck source=build-host.sh
source "$here/build-host.sh"

PY=${PY:-.venv/bin/python}
t0=$SECONDS
step() { echo "[test-compose $((SECONDS - t0)) s] $*"; }

if ! engine_answers && { ((EUID != 0)) || ! command -v apt-get >/dev/null; } && ! command -v dockerd >/dev/null; then
  echo "test-compose SKIPPED: no Docker engine answers and none can be installed here (needs root and apt-get)"
  exit 0
fi

# What a test killed before its own teardown left behind: containers, networks, volumes of its project.
leftovers_remove() {
  engine_answers || return 0
  local project
  for project in $(docker ps -a --format '{{.Label "com.docker.compose.project"}}' | grep '^astraflow-test-' | sort -u); do
    echo "removing what test project $project left behind"
    docker ps -aq --filter "label=com.docker.compose.project=$project" | xargs -r docker rm -f >/dev/null
  done
  docker network ls -q --filter "name=astraflow-test-" | xargs -r docker network rm >/dev/null || true
  docker volume ls -q --filter "name=astraflow-test-" | xargs -r docker volume rm >/dev/null || true
}

trap 'leftovers_remove; engine_stop' EXIT
trap 'exit 130' INT TERM
engine_install
engine_start
step "engine ready"
base_image_build
build_host_fill

export ASTRAFLOW_BASE_IMAGE=$BASE_IMAGE ASTRAFLOW_TORCH_INDEX_URL= COMPOSE_BAKE=false
compose=$("$PY" -c "import compose, pathlib; print(pathlib.Path(compose.__file__).with_name('docker-compose'))")
step "building astraflow:local FROM $BASE_IMAGE ($("$compose" version --short))"
"$compose" -f infra/docker-compose.tansu-seaweedfs.yml build --progress plain topics 2>&1 \
  | grep -E '^#[0-9]+ (\[|DONE|CACHED|ERROR)|naming to|ERROR|error' || true
if ! docker image inspect astraflow:local >/dev/null 2>&1; then
  echo "the image build failed: astraflow:local is missing" >&2
  exit 1
fi
docker image ls astraflow:local --format 'built {{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}'
# The secured variant's TLS terminator: stunnel4 on the same base (apt, cached after the first build).
"$compose" -f infra/docker-compose.secure.yml build --progress plain tls 2>&1 \
  | grep -E '^#[0-9]+ (DONE|ERROR)|naming to|ERROR|error' || true
docker image inspect astraflow-tls:local >/dev/null
docker image prune -f >/dev/null  # the previous build's image, now untagged
step "image built"

engine_objects() { docker ps -aq; docker volume ls -q; docker network ls -q; }
before=$(engine_objects | sort)
# The suite's own fixtures stay on the embedded stack: this engine is for the compose stack only.
ASTRAFLOW_TEST_STACK=embedded ASTRAFLOW_COMPOSE_LIVE=1 "$PY" -m pytest -q -s -ra -p no:cacheprovider tests/test_compose.py
left=$(comm -13 <(echo "$before") <(engine_objects | sort))
if [[ -n "$left" ]]; then
  echo "the compose test left containers, volumes or networks behind: $left" >&2
  exit 1
fi
step "done: nothing left behind (containers, volumes, networks)"
