#!/usr/bin/env bash
# Set everything up and run the whole test suite (unit + end-to-end against the
# real broker process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
# --durations: the 25 slowest tests, so a run that nears CI's time limit shows where it went.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
status=$?
set -e
exit $status
