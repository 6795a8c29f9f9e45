#!/usr/bin/env python3
"""What a JMS selector evaluation costs against a large string property (core/selectors):
LIKE patterns of several shapes against one value, each as a ratio to a plain
`'%b%'` scan of the same value in the same run, and what the evaluation budget
refuses.

    .venv/bin/python bench/selector_cost.py                 # a 1 MiB value
    .venv/bin/python bench/selector_cost.py --size 4194304 --reps 7

A benchmark: it prints figures and asserts nothing.  Figures from a busy machine are
indicative; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amqpbroker.core.selectors import SelectorBudgetExceeded, compile_selector  # noqa: E402

SHAPES = [
    ("'%b%' (reference)", "%b%"),
    ("'%' + 4,009 '_' + 'b%' (4,012 chars)", "%" + "_" * 4009 + "b%"),
    ("'%' + 10 '_' + 'b%'", "%" + "_" * 10 + "b%"),
    ("'abc%' (prefix)", "abc%"),
    ("'%needle%needle%'", "%needle%needle%"),
    ("'%a_b%' ('_' inside a part)", "%a_b%"),
    ("'%a' + 3,000 '_' + 'b%' (over the budget)", "%a" + "_" * 3000 + "b%"),
]


def best(fn, reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1 << 20, help="characters of the property value")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    lookup = {"v": "a" * a.size}.get
    reference = None
    print(f"value: {a.size:,} characters ('a' only: no pattern matches); best of {a.reps}")
    for name, pattern in SHAPES:
        sel = compile_selector(f"v LIKE '{pattern}'")

        def evaluate() -> str:
            try:
                return str(sel.matches(lookup))
            except SelectorBudgetExceeded:
                return "refused (budget)"
        outcome = evaluate()
        t = best(evaluate, a.reps)
        reference = reference or t
        print(f"  {name:<46} {t * 1000:10.3f} ms  x{t / reference:8.1f}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
