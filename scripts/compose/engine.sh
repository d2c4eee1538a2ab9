# shellcheck shell=bash
# A Docker engine for `make test-compose`, sourced by scripts/compose/test.sh.
#
# The engine is Debian's docker.io, started by hand (CI machines have no init system) on a socket of
# its own under $COMPOSE_STATE, not /var/run/docker.sock: other test runs and tools on the same machine
# must not see this engine (the test fixtures use containers only when ASTRAFLOW_TEST_STACK=docker). An engine that already answers (DOCKER_HOST or the default socket) is used as it
# is and left running.

COMPOSE_STATE=${COMPOSE_STATE:-/var/tmp/astraflow-compose}
ENGINE_STARTED_PID=""

engine_install() {
  # apt uses plain http through the proxy; docker.io brings containerd and runc, iptables the bridge
  # network's NAT, mmdebstrap the base image (scripts/compose/base-image.sh).
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  ((${#missing[@]})) || return 0
  echo "installing ${missing[*]} (apt) ..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

engine_answers() {
  timeout 10 docker info --format '{{.ServerVersion}}' >/dev/null 2>&1
}

engine_start() {
  if [[ -n "${DOCKER_HOST:-}" ]] && engine_answers; then
    echo "using the Docker engine at DOCKER_HOST=$DOCKER_HOST"
    return 0
  fi
  if [[ -z "${DOCKER_HOST:-}" ]] && engine_answers; then
    echo "using the Docker engine at the default socket"
    return 0
  fi
  mkdir -p "$COMPOSE_STATE"
  export DOCKER_HOST="unix://$COMPOSE_STATE/docker.sock"
  if engine_answers; then  # ours, from an earlier run that was not stopped (e.g. SIGKILLed)
    echo "using the Docker engine at $DOCKER_HOST (started earlier)"
    return 0
  fi
  rm -f "$COMPOSE_STATE/docker.sock" "$COMPOSE_STATE/dockerd.pid"
  dockerd --host "$DOCKER_HOST" --data-root "$COMPOSE_STATE/data" --exec-root "$COMPOSE_STATE/exec" \
    --pidfile "$COMPOSE_STATE/dockerd.pid" >"$COMPOSE_STATE/dockerd.log" 2>&1 &
  ENGINE_STARTED_PID=$!
  local waited=0
  until engine_answers; do
    if ! kill -0 "$ENGINE_STARTED_PID" 2>/dev/null || ((waited >= 60)); then
      echo "dockerd did not come up (its log: $COMPOSE_STATE/dockerd.log):" >&2
      tail -n 30 "$COMPOSE_STATE/dockerd.log" >&2
      return 1
    fi
    sleep 0.5
    ((waited += 1)) || true
  done
  echo "dockerd $(docker info --format '{{.ServerVersion}}') started by hand (pid $ENGINE_STARTED_PID, $DOCKER_HOST)"
}

engine_stop() {
  # Only the engine this script started, by its PID: SIGTERM stops its containers and its containerd.
  [[ -n "$ENGINE_STARTED_PID" ]] || return 0
  kill -TERM "$ENGINE_STARTED_PID" 2>/dev/null || return 0
  local waited=0
  while kill -0 "$ENGINE_STARTED_PID" 2>/dev/null && ((waited < 60)); do
    sleep 0.5
    ((waited += 1)) || true
  done
  if kill -0 "$ENGINE_STARTED_PID" 2>/dev/null; then
    echo "dockerd (pid $ENGINE_STARTED_PID) outlived 30 s after SIGTERM: SIGKILL" >&2
    kill -KILL "$ENGINE_STARTED_PID" 2>/dev/null || true
  fi
  echo "dockerd (pid $ENGINE_STARTED_PID) stopped"
  ENGINE_STARTED_PID=""
}
