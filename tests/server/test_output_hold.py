"""When a connection's output may go out, given the store batches holding the
delivered marks of what it carries (server/engine.py OutputHold)."""

from __future__ import annotations

from amqpbroker.server.engine import OutputHold


def test_an_entry_written_by_the_current_batch_needs_no_wait():
    hold = OutputHold()
    assert hold.need(stored_in=7, current=7) is None and not hold.held


def test_an_older_entry_waits_for_the_batch_with_its_mark():
    hold = OutputHold()
    assert hold.need(stored_in=3, current=7) == 7 and hold.held
    assert hold.need(stored_in=4, current=7) is None          # already waiting for 7
    assert hold.committed(7) and not hold.held


def test_output_held_over_several_turns_waits_for_the_latest_batch():
    hold = OutputHold()
    assert hold.need(stored_in=1, current=7) == 7
    assert hold.need(stored_in=2, current=8) == 8             # the next turn: another mark
    assert not hold.committed(7) and hold.held               # 7 alone does not release
    assert hold.committed(8) and not hold.held


def test_after_a_release_a_new_hold_starts_afresh():
    hold = OutputHold()
    hold.need(stored_in=1, current=5)
    hold.committed(5)
    assert hold.need(stored_in=2, current=6) == 6 and hold.held
