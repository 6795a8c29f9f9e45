#!/usr/bin/env bash
# Container engine and images for the compose interop run and the container tests.
#
#   scripts/containers.sh up      install + start a Docker engine (host networking only)
#   scripts/containers.sh build   base images (if absent), wheels, broker + interop images
#   scripts/containers.sh compose the interop suite against the broker container (compose.yaml)
#   scripts/containers.sh compose-ha  the compose `ha` profile: ZooKeeper, a replicated pair (both
#                                 healthy, the backup with its listener closed), the interop suite
#                                 against the pair, then kill -9 of the live broker: the backup takes over
#   scripts/containers.sh compose-cluster   the interop suite against each node of the compose
#                                           `cluster` profile (ZooKeeper + three nodes)
#   scripts/containers.sh down    remove containers, stop the engine we started
#
# No image registry is reachable on the build machines: the base image is made
# locally with debootstrap from the machine's own Debian mirror, and the images
# install wheels built on the host (pip inside a container build cannot reach PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-local/debian-py:bookworm}
BROKER_IMAGE=${BROKER_IMAGE:-amqpbroker:local}
INTEROP_IMAGE=${INTEROP_IMAGE:-amqpbroker-interop:local}
ZOOKEEPER_IMAGE=${ZOOKEEPER_IMAGE:-amqpbroker-zookeeper:local}
# The broker image's extras: kazoo for the compose `ha` and `cluster` profiles.
BROKER_EXTRAS=${BROKER_EXTRAS:-[ha,cluster]}
STATE=${CONTAINERS_STATE:-/tmp/amqpbroker-containers}
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

log() { echo "[containers] $*" >&2; }

debian_mirror() {
  # The mirror this machine's apt already uses (deb822 or one-line format).
  local uri
  uri=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)
  if [ -z "$uri" ]; then
    uri=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -n1 || true)
  fi
  echo "${uri:?no Debian mirror found in the apt configuration}"
}

engine_up() {
  if ! command -v dockerd >/dev/null || ! { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; } \
      || ! command -v debootstrap >/dev/null; then
    log "installing docker.io, docker-compose, debootstrap"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
      --no-install-recommends docker.io docker-compose debootstrap >/dev/null
  fi
  mkdir -p "$STATE"
  if docker info >/dev/null 2>&1; then
    log "engine already running"
    return
  fi
  log "starting dockerd (host networking only)"
  $SUDO dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
    >"$STATE/dockerd.log" 2>&1 &
  echo $! >"$STATE/dockerd.pid"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && return
    sleep 0.5
  done
  log "dockerd did not come up:"; tail -n 30 "$STATE/dockerd.log" >&2
  exit 1
}

base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    return
  fi
  local root="$STATE/rootfs" mirror
  mirror=$(debian_mirror)
  log "building $BASE_IMAGE with debootstrap (a few minutes)"
  $SUDO rm -rf "$root"
  $SUDO debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates,libssl3,libsasl2-2,libsasl2-modules,libqpid-proton-cpp12,libqpid-proton11,nodejs \
    bookworm "$root" "$mirror" >"$STATE/debootstrap.log" 2>&1 || {
      log "debootstrap failed:"; tail -n 30 "$STATE/debootstrap.log" >&2; exit 1; }
  $SUDO tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
  $SUDO rm -rf "$root"
}

zookeeper_image() {
  # ZooKeeper for the compose `ha` profile, from Debian's package (as the base image:
  # debootstrap from the machine's mirror; no registry).
  if docker image inspect "$ZOOKEEPER_IMAGE" >/dev/null 2>&1; then
    return
  fi
  local root="$STATE/zk-rootfs" mirror
  mirror=$(debian_mirror)
  log "building $ZOOKEEPER_IMAGE with debootstrap (a few minutes)"
  $SUDO rm -rf "$root"
  $SUDO debootstrap --variant=minbase --include=zookeeper,default-jre-headless \
    bookworm "$root" "$mirror" >"$STATE/debootstrap-zk.log" 2>&1 || {
      log "debootstrap (zookeeper) failed:"; tail -n 30 "$STATE/debootstrap-zk.log" >&2; exit 1; }
  $SUDO tar -C "$root" -c . | docker import - "$ZOOKEEPER_IMAGE" >/dev/null
  $SUDO rm -rf "$root"
}

wheels() {
  log "building wheels"
  rm -rf wheelhouse
  .venv/bin/python -m pip wheel -q ".$BROKER_EXTRAS" -w wheelhouse
}

build() {
  base_image
  zookeeper_image
  wheels
  log "building $BROKER_IMAGE"
  docker build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRAS="$BROKER_EXTRAS" \
    -t "$BROKER_IMAGE" . >/dev/null
  if [ -f interop/Dockerfile ]; then
    bash interop/setup.sh >"$STATE/interop-setup.log" 2>&1 || {
      log "interop/setup.sh failed:"; tail -n 30 "$STATE/interop-setup.log" >&2; exit 1; }
    log "building $INTEROP_IMAGE"
    docker build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -f interop/Dockerfile \
      -t "$INTEROP_IMAGE" . >/dev/null
  fi
}

engine_down() {
  if docker info >/dev/null 2>&1; then
    local ids
    ids=$(docker ps -aq || true)
    [ -n "$ids" ] && docker rm -f $ids >/dev/null 2>&1 || true
  fi
  if [ -f "$STATE/dockerd.pid" ]; then
    $SUDO kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
    for _ in $(seq 1 40); do
      $SUDO kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null || break
      sleep 0.25
    done
    rm -f "$STATE/dockerd.pid"
  fi
  if mountpoint -q /run/docker/netns/default 2>/dev/null; then
    $SUDO umount /run/docker/netns/default || true
  fi
}

compose() {
  # Compose v2 (`docker compose`) when the engine has it, else the standalone
  # `docker-compose` (Debian 12 packages 1.29, which reads compose.yaml as well).
  if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

compose_interop() {
  # The whole interop suite against the broker container; the exit status is the runner's.
  local project="amqpbroker-interop-$$" status=0
  export AMQP_PORT MANAGEMENT_PORT BROKER_IMAGE INTEROP_IMAGE BASE_IMAGE
  AMQP_PORT=$(free_port)
  MANAGEMENT_PORT=$(free_port)
  log "compose interop run (AMQP port $AMQP_PORT)"
  compose -p "$project" up --no-build --abort-on-container-exit --exit-code-from interop || status=$?
  compose -p "$project" down -v >/dev/null 2>&1 || true
  return $status
}

compose_cluster() {
  # The interop suite against each node of the `cluster` profile (compose.yaml): three
  # nodes and ZooKeeper ($ZOOKEEPER_IMAGE); the exit status is the runner's.
  local project="amqpbroker-cluster-$$" status=0
  export BROKER_IMAGE INTEROP_IMAGE ZOOKEEPER_IMAGE BASE_IMAGE
  if ! docker image inspect "$ZOOKEEPER_IMAGE" >/dev/null 2>&1; then
    log "no ZooKeeper image $ZOOKEEPER_IMAGE (the compose ha/cluster profiles need it)"; return 1
  fi
  log "compose cluster interop run (nodes on 5701-5703)"
  compose -p "$project" --profile cluster up --no-build --abort-on-container-exit \
    --exit-code-from interop-cluster interop-cluster || status=$?
  if [ "$status" != 0 ]; then
    compose -p "$project" --profile cluster logs --no-color --tail 80 node-a node-b node-c >&2 || true
  fi
  compose -p "$project" --profile cluster down -v >/dev/null 2>&1 || true
  return $status
}

wait_healthy() {
  # $1 project, $2.. services: until docker reports each healthy (or 120 s).
  local project=$1 service id status
  shift
  for service in "$@"; do
    for _ in $(seq 1 240); do
      id=$(compose -p "$project" ps -q "$service")
      status=$(docker inspect --format '{{.State.Health.Status}}' "$id" 2>/dev/null || echo none)
      [ "$status" = healthy ] && break
      sleep 0.5
    done
    log "$service: $status"
    [ "$status" = healthy ] || return 1
  done
}

accepts() {
  python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2).close()' "$1" 2>/dev/null
}

compose_ha() {
  # The `ha` profile (docs/ha.md): both brokers healthy (the backup's health check
  # passes with its AMQP listener closed), the interop suite against the pair, then
  # kill -9 of the live broker's container and the backup taking over.
  local project="amqpbroker-ha-$$" status=0
  export BROKER_IMAGE INTEROP_IMAGE ZOOKEEPER_IMAGE ZOOKEEPER_PORT HA_A_PORT HA_B_PORT HA_A_MANAGEMENT_PORT \
    HA_B_MANAGEMENT_PORT HA_A_REPLICATION_PORT HA_B_REPLICATION_PORT
  ZOOKEEPER_PORT=$(free_port); HA_A_PORT=$(free_port); HA_B_PORT=$(free_port)
  HA_A_MANAGEMENT_PORT=$(free_port); HA_B_MANAGEMENT_PORT=$(free_port)
  HA_A_REPLICATION_PORT=$(free_port); HA_B_REPLICATION_PORT=$(free_port)
  local compose="compose -p $project --profile ha"
  log "compose ha profile (ZooKeeper $ZOOKEEPER_PORT, brokers $HA_A_PORT / $HA_B_PORT)"
  $compose up -d --no-build zookeeper broker-a broker-b || status=$?
  if [ $status = 0 ] && wait_healthy "$project" zookeeper broker-a broker-b; then
    if accepts "$HA_B_PORT"; then log "the backup's AMQP listener is open"; status=1; fi
    [ $status = 0 ] && { $compose run --rm interop-ha || status=$?; }
    if [ $status = 0 ]; then
      log "kill -9 of the live broker (broker-a)"
      $compose kill -s SIGKILL broker-a >/dev/null
      status=1
      for _ in $(seq 1 120); do
        if accepts "$HA_B_PORT"; then status=0; log "broker-b took over"; break; fi
        sleep 0.5
      done
    fi
  else
    status=1
  fi
  if [ $status != 0 ]; then $compose logs --tail 60 >&2 || true; fi
  $compose down -v >/dev/null 2>&1 || true
  return $status
}

case "${1:-}" in
  up) engine_up ;;
  build) build ;;
  compose) compose_interop ;;
  compose-ha) compose_ha ;;
  compose-cluster) compose_cluster ;;
  down) engine_down ;;
  *) echo "usage: $0 up|build|compose|compose-ha|compose-cluster|down" >&2; exit 2 ;;
esac
