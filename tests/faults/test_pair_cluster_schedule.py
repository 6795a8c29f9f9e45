"""The pure parts of the paired cluster's nemesis (tests/faults/pair_cluster_nemesis.py):
the seeded schedule and the checker's client-side view of node a's accept windows."""

from __future__ import annotations

from tests.faults.checker import Window
from tests.faults.pair_cluster_nemesis import producer_view_overlaps, schedule


def test_a_seed_draws_the_same_schedule_and_pauses_on_both_sides_of_the_session_timeouts():
    assert schedule(7, 60, 2.0, 4.0) == schedule(7, 60, 2.0, 4.0)
    assert schedule(7, 60, 2.0, 4.0) != schedule(8, 60, 2.0, 4.0)
    faults = [f for seed in range(1, 7) for f in schedule(seed, 60, 2.0, 4.0)]
    pauses = [f.duration for f in faults if f.kind.startswith("pause")]
    assert any(d < 2.0 for d in pauses) and any(d > 4.0 for d in pauses)
    assert {(f.kind, f.target) for f in faults} == {("kill", "live"), ("kill", "backup"), ("pause", "live"),
                                                   ("pause-zk", "zookeeper"), ("kill", "b")}


def windows() -> list[Window]:
    return [Window("primary", "n1", 1, 10.0, 20.0, "kill -9"), Window("backup", "n2", 2, 22.0, 40.0, "closed"),
            Window("primary", "n1", 3, 41.0)]


def test_accepts_one_broker_after_the_other_are_no_overlap():
    found, spans = producer_view_overlaps([("primary", 11.0), ("primary", 20.3), ("backup", 23.0),
                                           ("backup", 39.0), ("primary", 42.0)], windows())
    assert found == []
    assert spans == {"primary": [(11.0, 20.3), (42.0, 42.0)], "backup": [(23.0, 39.0)]}


def test_two_brokers_seen_accepting_at_once_is_an_overlap():
    found, _ = producer_view_overlaps([("primary", 11.0), ("backup", 23.0), ("primary", 25.0)], windows())
    assert len(found) == 1 and "primary" in found[0] and "backup" in found[0]


def test_an_accept_before_any_window_of_its_broker_is_reported():
    found, _ = producer_view_overlaps([("backup", 15.0)], windows())
    assert found == ["backup answered Accepted at 15.000 with no accept window open before"]
