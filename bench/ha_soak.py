#!/usr/bin/env python3
"""A soak of the HA pair under the fault suite's nemesis (tests/faults/test_nemesis.py,
docs/ha.md "Fault cases"): more seeds, longer schedules than CI runs.  Prints each
seed's faults and verdict, then the totals; exit status 1 when any seed lost an
Accepted durable message, saw overlapping accept windows or a broker process end on
its own.  A benchmark-style runner: it needs Debian's zookeeper package (as the tests).

    .venv/bin/python bench/ha_soak.py --schedules 50 --seconds 300 --first-seed 1000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.ha_harness import ZooKeeper  # noqa: E402
from tests.faults.test_nemesis import run_schedule  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--first-seed", type=int, default=1000)
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ha-soak-"))
    zk = ZooKeeper(root / "zk").start()
    bad: list[int] = []
    totals = {"durable": 0, "non_durable": 0, "duplicates": 0, "windows": 0}
    started = time.monotonic()
    try:
        for seed in range(a.first_seed, a.first_seed + a.schedules):
            try:
                v = run_schedule(zk, root / f"seed-{seed}", seed, a.seconds)
            except (AssertionError, TimeoutError) as exc:   # the pair did not come back: a finding too
                print(f"seed {seed}: did not settle: {str(exc)[:2000]}", flush=True)
                bad.append(seed)
                continue
            finally:
                shutil.rmtree(root / f"seed-{seed}", ignore_errors=True)
            totals["durable"] += v.accepted_durable
            totals["non_durable"] += v.accepted_non_durable
            totals["duplicates"] += v.duplicates
            totals["windows"] += len(v.windows)
            if not v.ok:
                bad.append(seed)
                print(f"seed {seed}: FAILED: lost {v.lost[:10]}; overlaps {v.overlaps}; exits {v.exits}\n{v.details}",
                      flush=True)
    finally:
        zk.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{a.schedules} schedules of {a.seconds:.0f} s in {time.monotonic() - started:.0f} s: "
          f"{totals['durable']} durable and {totals['non_durable']} non-durable messages Accepted, "
          f"{totals['duplicates']} duplicates, {totals['windows']} accept windows; failed seeds: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
