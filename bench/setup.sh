#!/usr/bin/env bash
# Install the benchmark prerequisites (Debian 12) and build the tools.
#   gcc, pkg-config                   toolchain
#   libqpid-proton11-dev              Qpid Proton C (proactor API) for bench/loadgen.c
#   libqpid-proton11-dev-examples     examples/c/broker.c: the C reference broker
#   rabbitmq-server                   RabbitMQ 3.10 (AMQP 1.0 plugin) reference broker
# apt does not start a RabbitMQ service here; bench/run.py runs its own node.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
pkgs="gcc pkg-config libqpid-proton11-dev libqpid-proton11-dev-examples rabbitmq-server"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y $missing
fi
# The package may have started (or tried to start) the system RabbitMQ
# service; it is not used by the benchmark.
"$here/build.sh"
echo "ready: run  $here/../.venv/bin/python $here/run.py"
