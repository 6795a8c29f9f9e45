"""The producer credit window (core/credit_window.py), row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.credit_window import GROW, INITIAL, SPREAD, CreditWindow


def test_starts_small_and_never_above_the_maximum():
    assert CreditWindow(1000).window == INITIAL
    assert CreditWindow(20).window == 20           # a configured maximum below the start
    assert CreditWindow(0).window == 1             # never nothing at all


def half_window(w: CreditWindow, per_read: list[int], seconds: float = 0.0, first_read: int = 0) -> float:
    """Transfers in reads of the given sizes, spread evenly over `seconds`; the time
    of the last."""
    at = 100.0
    step = seconds / max(1, len(per_read) - 1)
    for i, count in enumerate(per_read):
        at = 100.0 + i * step
        for _ in range(count):
            w.arrived(first_read + i, at)
    return at


@pytest.mark.parametrize("window, maximum, per_read, seconds, expected", [
    (64, 1000, [33], 0.0, 128),                   # the half window in one read: a burst, doubles
    (64, 1000, [16, 17], 0.001, 128),             # a quarter of the window in one read is enough
    (64, 1000, [15, 15, 3], 0.001, 64),           # less: stays
    (512, 1000, [257], 0.0, 1000),                # capped at the maximum
    (1000, 1000, [501], 0.0, 1000),
    (1000, 1000, [10] * 51, 0.05, 1000),          # a fast producer read a few at a time: stays
    (1000, 1000, [1] * 501, SPREAD * 0.99, 1000), # within the spread bound: stays
    (1000, 1000, [1] * 501, SPREAD * 2, 500),     # spread out (a slow producer): halves
    (128, 1000, [1] * 65, 1.0, 64),
    (64, 1000, [1] * 33, 1.0, 64),                # never below the start
    (20, 20, [1] * 11, 1.0, 20),                  # (a maximum below the start: that is the floor)
    (256, 1000, [64] + [1] * 65, 1.0, 512),       # a burst in a slow half window: the burst counts
])
def test_refill(window, maximum, per_read, seconds, expected):
    w = CreditWindow(maximum)
    w.window = window
    last = half_window(w, per_read, seconds)
    assert w.refill(last) == expected
    assert w.window == expected
    assert w.peak == 0 and w.first_at is None     # the next half window is counted afresh


def test_a_top_up_without_transfers_keeps_the_window():
    """A top-up not caused by a transfer (the flow gate releasing a held producer)."""
    w = CreditWindow(1000)
    assert w.refill(5.0) == INITIAL


def test_a_read_split_by_a_top_up_counts_on_from_zero():
    w = CreditWindow(1000)
    half_window(w, [33], first_read=7)
    assert w.refill(100.0) == 128
    for _ in range(20):                           # the rest of the same read
        w.arrived(7, 100.0)
    assert w.peak == 20


def test_a_bursting_producer_reaches_the_maximum_in_a_few_top_ups():
    w = CreditWindow(1000)
    sizes = []
    for read in range(6):
        last = half_window(w, [w.window // 2 + 1], first_read=read)
        sizes.append(w.refill(last))
    assert sizes == [128, 256, 512, 1000, 1000, 1000]


def test_the_grow_share_is_a_quarter():
    assert GROW == 4
