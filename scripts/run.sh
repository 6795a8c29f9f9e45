#!/usr/bin/env bash
# Install and start the broker with embedded defaults: AMQP on 127.0.0.1:5672,
# data in ./data.  Extra arguments go to `amqpbroker serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
AMQPBROKER_EXTRAS=${AMQPBROKER_EXTRAS-} bash scripts/setup.sh
exec .venv/bin/amqpbroker serve "$@"
