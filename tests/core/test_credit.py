"""The producer credit window (core/credit.py), row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.credit import GROW, INITIAL, SHRINK, CreditWindow


def test_starts_small_and_never_above_the_maximum():
    assert CreditWindow(1000).window == INITIAL
    assert CreditWindow(20).window == 20           # a configured maximum below the start
    assert CreditWindow(0).window == 1             # never nothing at all


def half_window(w: CreditWindow, per_read: list[int], first_read: int = 0) -> None:
    for read, count in enumerate(per_read, start=first_read):
        for _ in range(count):
            w.arrived(read)


@pytest.mark.parametrize("window, maximum, per_read, expected", [
    (64, 1000, [33], 128),                        # the half window in one read: a burst, doubles
    (64, 1000, [16, 17], 128),                    # a quarter of the window in one read is enough
    (64, 1000, [15, 15, 3], 64),                  # less: stays
    (512, 1000, [257], 1000),                     # capped at the maximum
    (1000, 1000, [501], 1000),
    (256, 1000, [16] * 9, 256),                   # exactly a sixteenth at most: stays
    (256, 1000, [15] * 9, 128),                   # less in every read: halves
    (128, 1000, [1] * 65, 64),                    # one per read (a moderate rate): halves
    (64, 1000, [1] * 33, 64),                     # never below the start
    (20, 20, [1] * 11, 20),                       # (a maximum below the start: that is the floor)
])
def test_refill(window, maximum, per_read, expected):
    w = CreditWindow(maximum)
    w.window = window
    half_window(w, per_read)
    assert w.refill() == expected
    assert w.window == expected
    assert w.peak == 0                            # the next half window is counted afresh


def test_a_top_up_without_transfers_keeps_the_window():
    """A top-up not caused by a transfer (the flow gate releasing a held producer)."""
    w = CreditWindow(1000)
    assert w.refill() == INITIAL


def test_a_read_split_by_a_top_up_counts_on_from_zero():
    w = CreditWindow(1000)
    half_window(w, [33], first_read=7)
    assert w.refill() == 128
    for _ in range(20):                           # the rest of the same read
        w.arrived(7)
    assert w.peak == 20


def test_a_bursting_producer_reaches_the_maximum_in_a_few_top_ups():
    w = CreditWindow(1000)
    sizes = []
    for read in range(6):
        half_window(w, [w.window // 2 + 1], first_read=read)
        sizes.append(w.refill())
    assert sizes == [128, 256, 512, 1000, 1000, 1000]


def test_the_bounds_are_shares_of_the_window():
    assert GROW < SHRINK
