#!/usr/bin/env bash
# Build the benchmark tools into bench/build/ (ignored by git):
#   bench/build/loadgen   AMQP 1.0 load generator (proton-C proactor)
#   bench/build/amqp-bench  the independent load/latency tool (bench/amqp-bench/)
#   bench/build/cbroker   Qpid Proton C example broker (reference broker)
# Needs: gcc, pkg-config, libqpid-proton11-dev, libqpid-proton11-dev-examples
# (bench/setup.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/build"
mkdir -p "$out"

pc_flags() {
  # Debian's libqpid-proton.pc covers core + proactor in one library; fall
  # back to the split libraries if that is not the case on some system.
  if pkg-config --exists libqpid-proton; then
    pkg-config --cflags --libs libqpid-proton
  else
    echo "-lqpid-proton-proactor -lqpid-proton-core"
  fi
}
FLAGS="$(pc_flags)"
# Check that the proactor symbols are reachable with the pkg-config flags.
probe="$out/.probe.c"
cat > "$probe" <<'C'
#include <proton/proactor.h>
int main(void) { pn_proactor_t *p = pn_proactor(); pn_proactor_free(p); return 0; }
C
if ! gcc -o "$out/.probe" "$probe" $FLAGS 2>/dev/null; then
  FLAGS="$FLAGS -lqpid-proton-proactor -lqpid-proton-core"
fi
rm -f "$probe" "$out/.probe"

echo "building $out/loadgen"
gcc -O2 -Wall -Wextra -std=gnu11 -o "$out/loadgen" "$here/loadgen.c" $FLAGS -lpthread

# amqp-bench: the independent load and latency tool (an unmodified copy in
# bench/amqp-bench/, see its README), built here so that bench/rates.py and the
# bench smoke test run it beside loadgen.
echo "building $out/amqp-bench"
gcc -O2 -g -Wall -Wextra -std=gnu11 -o "$out/amqp-bench" "$here/amqp-bench/amqp-bench.c" $FLAGS

ex=/usr/share/proton/examples/c
if [ -f "$ex/broker.c" ]; then
  echo "building $out/cbroker (from $ex/broker.c)"
  cp "$ex/broker.c" "$ex/thread.h" "$out/"
  if [ -d "$ex/ssl-certs" ]; then rm -rf "$out/ssl-certs"; cp -r "$ex/ssl-certs" "$out/"; fi
  gcc -O2 -o "$out/cbroker" "$out/broker.c" $FLAGS -lpthread
else
  echo "skipping cbroker: $ex/broker.c not found (apt-get install libqpid-proton11-dev-examples)" >&2
fi
