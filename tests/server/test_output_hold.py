"""When a connection's output may go out, given the store batches that must commit
first (server/engine.py OutputHold; the batch comes from store/durability.py)."""

from __future__ import annotations

from amqpbroker.core.entries import held_batch, hold_code
from amqpbroker.server.engine import OutputHold


def test_nothing_to_wait_for_holds_nothing():
    hold = OutputHold()
    assert hold.need(-1) is None and not hold.held


def test_a_delivery_waits_for_its_batch():
    hold = OutputHold()
    assert hold.need(7) == 7 and hold.held
    assert hold.need(7) is None                               # already waiting for 7
    assert hold.need(5) is None                               # 5 commits before 7
    assert hold.committed(7) and not hold.held


def test_output_held_over_several_turns_waits_for_the_latest_batch():
    hold = OutputHold()
    assert hold.need(7) == 7
    assert hold.need(8) == 8                                  # the next turn: another mark
    assert not hold.committed(7) and hold.held               # 7 alone does not release
    assert hold.committed(8) and not hold.held


def test_after_a_release_a_new_hold_starts_afresh():
    hold = OutputHold()
    hold.need(5)
    hold.committed(5)
    assert hold.need(6) == 6 and hold.held


def test_hold_codes_never_equal_a_batch_number():
    for batch in (0, 1, 7, 10**9):
        code = hold_code(batch)
        assert code < -1 and held_batch(code) == batch
    assert hold_code(-1) == -1 and held_batch(-1) == -1
    assert held_batch(5) == 5        # an entry not handed out yet: the batch storing it
