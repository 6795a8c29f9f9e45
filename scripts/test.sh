#!/usr/bin/env bash
# Set everything up and run the whole test suite (unit + end-to-end against the
# real broker process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
exit $status
