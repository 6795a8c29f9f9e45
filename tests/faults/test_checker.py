"""The checker's step-down rule (tests/faults/checker.py `unprovoked_stepdowns`) and
the reason it reads from a broker's log: each case can fail."""

from __future__ import annotations

from tests.faults.checker import WINDOW_RE, FaultSpan, Window, unprovoked_stepdowns

# The pause of the old live broker ("primary") let the backup take over; the backup's
# window then closed "invalid" (its lock gone) with no fault on it or on ZooKeeper.
PAUSE_OF_THE_OLD_ONE = FaultSpan(10.0, 14.0, frozenset({"primary"}))
NEW_LIVE_DEPOSED = Window("backup", "n2", 2, 13.0, 15.5, "closed", "invalid")


def test_a_live_broker_deposed_with_no_fault_on_it_or_on_zookeeper_is_reported():
    found = unprovoked_stepdowns([NEW_LIVE_DEPOSED], [PAUSE_OF_THE_OLD_ONE], slack=9.0)
    assert len(found) == 1 and found[0].startswith("backup activation 2 stepped down at 15.500")


def test_a_step_down_explained_by_a_fault_on_the_broker_or_on_zookeeper_is_not():
    for touched in ({"backup"}, {"zookeeper"}):
        spans = [PAUSE_OF_THE_OLD_ONE, FaultSpan(3.0, 5.0, frozenset(touched))]   # within the slack
        assert unprovoked_stepdowns([NEW_LIVE_DEPOSED], spans, slack=9.0) == []
    # Too long before the window (beyond the slack), or after it: no explanation.
    for span in (FaultSpan(1.0, 2.0, frozenset({"backup"})), FaultSpan(16.0, 17.0, frozenset({"zookeeper"}))):
        assert len(unprovoked_stepdowns([NEW_LIVE_DEPOSED], [span], slack=9.0)) == 1


def test_other_endings_are_not_step_downs():
    for w in (Window("backup", "n2", 2, 13.0, 15.5, "closed", "paused"), Window("backup", "n2", 2, 13.0),
              Window("backup", "n2", 2, 13.0, 15.5, "kill -9")):
        assert unprovoked_stepdowns([w], [], slack=9.0) == []


def test_the_reason_is_read_from_the_log_line():
    line = ("2026-11-27 01:55:22,535 WARNING amqpbroker.ha: ha: accept window closed: node=d25a64a3c4b7 "
            "activation=2 at=1795744522.519321 (invalid)")
    m = WINDOW_RE.search(line)
    assert m is not None and m.group(5) == "invalid" and float(m.group(4)) == 1795744522.519321
