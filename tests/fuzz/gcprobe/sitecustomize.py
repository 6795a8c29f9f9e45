"""Loaded by the fuzz run's broker process only (its PYTHONPATH starts here, see
tests/fuzz/conftest.py): writes one line to stderr for every garbage collection
longer than 10 ms, so that a slow canary round trip can be told apart from the
collector's pause (the broker collects its young generation every 50,000
allocations, cli.tune_gc: under connection churn that is tens of milliseconds).
Instrumentation only: nothing in the broker changes."""

import gc
import sys
import time

_started = [0.0, 0.0]


def _probe(phase, info):
    if phase == "start":
        _started[0], _started[1] = time.time(), time.perf_counter()
        return
    took = time.perf_counter() - _started[1]
    if took > 0.010:
        sys.stderr.write(f"fuzz-gc-probe: generation {info['generation']} at {_started[0]:.6f} "
                         f"took {took:.6f} collected {info['collected']}\n")


gc.callbacks.append(_probe)
