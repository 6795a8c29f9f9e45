"""core/credit.py, row by row: a transfer beyond credit, a block queue's room, one
producer's share of it, when to top up."""

from __future__ import annotations

import pytest

from amqpbroker.core.credit import beyond_credit, room, share, top_up_below
from amqpbroker.core.limits import Overflow, QueueLimits

BLOCK = QueueLimits(max_depth=100, overflow=Overflow.BLOCK)
BYTES = QueueLimits(max_bytes=1000, overflow=Overflow.BLOCK)
BOTH = QueueLimits(max_depth=100, max_bytes=1000, overflow=Overflow.BLOCK)


@pytest.mark.parametrize("credit_left, beyond", [
    (20, False),    # plenty left
    (1, False),     # the last one granted
    (0, True),      # nothing was left for it: the first beyond
    (-5, True),     # further beyond
])
def test_beyond_credit(credit_left, beyond):
    assert beyond_credit(credit_left) is beyond


@pytest.mark.parametrize("limits, depth, size, staged, staged_bytes, message_size, expected", [
    (None, 0, 0, 0, 0, 0, None),                                           # no limits: not credit's business
    (QueueLimits(max_depth=5, overflow=Overflow.REJECT), 0, 0, 0, 0, 0, None),   # reject: refused per message
    (QueueLimits(max_depth=5, overflow=Overflow.DROP_HEAD), 9, 0, 0, 0, 0, None),
    (QueueLimits(overflow=Overflow.BLOCK), 10**6, 0, 0, 0, 0, None),       # block without a limit
    (BLOCK, 0, 0, 0, 0, 0, 100),
    (BLOCK, 60, 0, 0, 0, 0, 40),
    (BLOCK, 60, 0, 15, 0, 0, 25),                                           # staged sends take room
    (BLOCK, 100, 0, 0, 0, 0, 0),                                            # full
    (BLOCK, 130, 0, 0, 0, 0, 0),                                            # over (a lowered limit)
    (BYTES, 0, 0, 0, 0, 0, 1),                                              # size unknown: one at a time
    (BYTES, 0, 0, 0, 0, 100, 10),
    (BYTES, 0, 950, 0, 0, 100, 1),                                          # some room: one more, as `full` allows
    (BYTES, 0, 1000, 0, 0, 100, 0),
    (BYTES, 0, 800, 0, 100, 100, 1),                                        # staged bytes count
    (BYTES, 0, 0, 0, 0, 300, 4),                                            # ceil(1000 / 300)
    (BOTH, 98, 0, 0, 0, 10, 2),                                             # the tighter of the two
    (BOTH, 0, 900, 0, 0, 10, 10),
])
def test_room(limits, depth, size, staged, staged_bytes, message_size, expected):
    assert room(limits, depth, size, staged, staged_bytes, message_size) == expected


@pytest.mark.parametrize("room_left, reserved, producers, window, expected", [
    (100, 0, 1, 1000, 50),       # one producer: half of the room at a time, never a window beyond it
    (1, 0, 1, 1000, 1),          # ... and the last message of it
    (2, 0, 1, 1000, 1),
    (100, 0, 1, 20, 20),         # never more than its window
    (100, 0, 4, 1000, 20),       # an even share, one kept for whoever comes next
    (10, 0, 3, 1000, 3),         # rounded up: nobody starves while there is room
    (100, 90, 2, 1000, 10),      # what the others hold is not room
    (100, 100, 2, 1000, 0),      # all promised to the others
    (100, 150, 2, 1000, 0),      # more promised than there is (the limit was lowered)
    (0, 0, 1, 1000, 0),          # full
    (-3, 0, 1, 1000, 0),         # over
    (5, 0, 0, 1000, 3),          # not counted yet among the producers
])
def test_share(room_left, reserved, producers, window, expected):
    assert share(room_left, reserved, producers, window) == expected


def test_producers_sharing_room_never_hold_more_than_the_room():
    """Producers asking in turn, each granted its share of what is left and using it:
    the credit held altogether never exceeds the room left, each gets some while there
    is room, and the queue fills exactly to its limit."""
    for limit in (1, 7, 100):
        for n in (1, 2, 3, 8):
            depth, held = 0, [0] * n
            for _ in range(10 * limit + 10):
                for i in range(n):
                    left = limit - depth
                    held[i] = max(held[i], share(left, sum(held) - held[i], n, 1000))
                    assert sum(held) <= left
                    if held[i]:           # it sends one
                        held[i] -= 1
                        depth += 1
            assert depth == limit, (limit, n)


def test_the_first_producer_leaves_room_for_the_next():
    room_left, holds = 10, []
    for n in (1, 2, 3):
        holds.append(share(room_left, sum(holds), n, 1000))
    assert holds == [5, 4, 1] and sum(holds) <= room_left


@pytest.mark.parametrize("target, expected", [(1000, 500), (20, 10), (3, 2), (1, 1), (0, 1)])
def test_top_up_below(target, expected):
    assert top_up_below(target) == expected
