#!/usr/bin/env bash
# Install and start the broker with embedded defaults: AMQP on 127.0.0.1:5672,
# data in ./data.  Extra arguments go to `amqpbroker serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
AMQPBROKER_EXTRAS=${AMQPBROKER_EXTRAS-} bash scripts/setup.sh
echo "run.sh: the commands are in .venv/bin (\`source .venv/bin/activate\` puts them on PATH):" \
     ".venv/bin/amqpbroker send|receive|admin|config --help" >&2
exec .venv/bin/amqpbroker serve "$@"
