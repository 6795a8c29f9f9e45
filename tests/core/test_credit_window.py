"""The producer credit window (core/credit_window.py), row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.credit_window import GAP, GROW, INITIAL, SPREAD, SUSTAIN, CreditWindow


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


LONG = 100.0 - 2 * SUSTAIN    # a run of bursts that began long enough before the half window (at 100.0)


@pytest.mark.parametrize("window, maximum, per_read, seconds, since, expected", [
    (64, 1000, [33], 0.0, LONG, 128),             # the half window in one read, bursts sustained: doubles
    (64, 1000, [16, 17], 0.001, LONG, 128),       # a quarter of the window in one read is a burst
    (64, 1000, [15, 15, 3], 0.001, LONG, 64),     # less: stays
    (64, 1000, [33], 0.0, None, 64),              # one burst alone (a catch-up): stays
    (64, 1000, [33], 0.0, 100.0 - SUSTAIN / 2, 64),   # bursts, not for long enough yet: stays
    (64, 1000, [1, 32], GAP * 2, LONG, 64),       # a burst after a pause: the run starts again, stays
    (512, 1000, [257], 0.0, LONG, 1000),          # capped at the maximum
    (1000, 1000, [501], 0.0, LONG, 1000),
    (1000, 1000, [10] * 51, 0.05, LONG, 1000),    # a fast producer read a few at a time: stays
    (1000, 1000, [1] * 501, SPREAD * 0.99, None, 1000),   # within the spread bound: stays
    (1000, 1000, [1] * 501, SPREAD * 2, None, 500),   # spread out (a slow producer): halves
    (128, 1000, [1] * 65, 1.0, None, 64),
    (64, 1000, [1] * 33, 1.0, None, 64),          # never below the start
    (20, 20, [1] * 11, 1.0, None, 20),            # (a maximum below the start: that is the floor)
])
def test_refill(window, maximum, per_read, seconds, since, expected):
    w = CreditWindow(maximum)
    w.window = window
    w.bursting_since = since
    last = half_window(w, per_read, seconds)
    assert w.refill(last) == expected
    assert w.window == expected
    assert w.peak == 0 and w.first_at is None     # the next half window is counted afresh


def test_a_half_window_without_a_burst_ends_the_run_of_bursts():
    w = CreditWindow(1000)
    w.bursting_since = LONG
    last = half_window(w, [1] * 33, 0.001)
    assert w.refill(last) == INITIAL and w.bursting_since is None


def test_a_catch_up_after_a_pause_does_not_grow_the_window():
    """amqp-bench at 5,000 msgs/s: 64 at once, nothing for ~97 ms (its pacing timer
    first fires then), then ~450 to catch up, as fast as credit comes back (a top-up
    every ~0.5 ms): the window stays at the start, so no read brings more than it."""
    w = CreditWindow(1000)
    at = half_window(w, [33])
    assert w.refill(at) == INITIAL
    for _ in range(31):                           # the rest of the first read
        w.arrived(0, at)
    at, read = at + 0.097, 1
    sizes = []
    for _ in range(14):                           # ~450 messages, a half window every 0.5 ms
        for _ in range(32):
            w.arrived(read, at)
        read += 1
        sizes.append(w.refill(at))
        at += 0.0005
    assert sizes == [INITIAL] * 14


def test_a_top_up_without_transfers_keeps_the_window():
    """A top-up not caused by a transfer (the flow gate releasing a held producer)."""
    w = CreditWindow(1000)
    assert w.refill(5.0) == INITIAL


def test_a_read_split_by_a_top_up_counts_on_from_zero():
    w = CreditWindow(1000)
    w.bursting_since = LONG
    half_window(w, [33], first_read=7)
    assert w.refill(100.0) == 128
    for _ in range(20):                           # the rest of the same read
        w.arrived(7, 100.0)
    assert w.peak == 20


def test_a_producer_bursting_without_end_reaches_the_maximum_in_a_few_top_ups_once_sustained():
    """Full speed: a half window in one read every 0.5 ms.  Nothing grows for SUSTAIN
    seconds; then every top-up doubles."""
    w = CreditWindow(1000)
    sizes, at, read = [], 100.0, 0
    while at < 100.0 + SUSTAIN + 0.003:
        for _ in range(w.window // 2 + 1):
            w.arrived(read, at)
        read += 1
        sizes.append(w.refill(at))
        at += 0.0005
    grown = [s for s in sizes if s > INITIAL]
    assert sizes[:int(SUSTAIN / 0.0005)] == [INITIAL] * int(SUSTAIN / 0.0005)
    assert grown[:5] == [128, 256, 512, 1000, 1000]


def test_the_grow_share_is_a_quarter():
    assert GROW == 4
