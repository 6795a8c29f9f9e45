"""AlarmWatch (server/alarm_watch.py): readings fed to Alarms, the heap trimmed
before memory counts, the log lines; the real readings of this process."""

from __future__ import annotations

import logging

import pytest

from amqpbroker.core.alarms import Alarms
from amqpbroker.server import alarm_watch
from amqpbroker.server.alarm_watch import AlarmWatch

MiB = 1 << 20


class FakeLoop:
    def __init__(self) -> None:
        self.timers: list = []

    def call_later(self, delay: float, fn):
        handle = type("H", (), {"cancel": lambda self: None})()
        self.timers.append((delay, fn))
        return handle


@pytest.fixture
def readings(monkeypatch):
    """Readings a test sets: RSS before and after a trim, free disk."""
    state = {"rss": 100 * MiB, "after_trim": None, "free": 10**12, "trims": 0, "now": 1000.0}

    def trim() -> bool:
        state["trims"] += 1
        if state["after_trim"] is not None:
            state["rss"] = state["after_trim"]
        return True

    monkeypatch.setattr(alarm_watch, "rss", lambda: state["rss"])
    monkeypatch.setattr(alarm_watch, "trim_heap", trim)
    monkeypatch.setattr(alarm_watch, "disk_free", lambda path: state["free"])
    monkeypatch.setattr(alarm_watch, "cgroup_limit", lambda files: None)
    return state


def watch(tmp_path, readings, **thresholds) -> tuple[AlarmWatch, Alarms, FakeLoop]:
    alarms = Alarms(**thresholds)
    loop = FakeLoop()
    return AlarmWatch(loop, alarms, tmp_path, 0.5, clock=lambda: readings["now"]), alarms, loop


def test_checks_repeat_every_interval(tmp_path, readings):
    w, alarms, loop = watch(tmp_path, readings)
    w.start()
    assert loop.timers == [(0.5, w.check)]
    assert alarms.memory_used == 100 * MiB and alarms.disk_free == 10**12 and alarms.physical_memory > 0
    w.close()


def test_memory_alarm_log_lines(tmp_path, readings, caplog):
    caplog.set_level(logging.INFO, "amqpbroker.alarms")
    w, alarms, _ = watch(tmp_path, readings, memory_high_watermark_absolute=50 * MiB)
    w.start()
    assert alarms.reasons == ["memory"] and readings["trims"] == 1      # trimmed first: still above
    rec = [r for r in caplog.records if "alarm" in r.getMessage()][-1]
    assert rec.levelno == logging.WARNING
    assert rec.getMessage() == ("memory alarm raised: broker RSS 100.0 MiB is above the high watermark 50.0 MiB "
                                "(memory_high_watermark_absolute): producers get no credit until it falls below "
                                "47.5 MiB (consumers keep draining)")
    readings["rss"] = 40 * MiB
    w.check()
    rec = caplog.records[-1]
    assert rec.levelno == logging.INFO and rec.getMessage().startswith(
        "memory alarm cleared: broker RSS 40.0 MiB, below 47.5 MiB (high watermark 50.0 MiB): producers get credit")


def test_freed_memory_is_given_back_before_it_counts(tmp_path, readings):
    readings["after_trim"] = 30 * MiB          # malloc held what was freed: no alarm
    w, alarms, _ = watch(tmp_path, readings, memory_high_watermark_absolute=50 * MiB)
    w.start()
    assert not alarms.blocking and readings["trims"] == 1 and alarms.memory_used == 30 * MiB


def test_trims_at_most_every_few_seconds_and_only_at_the_limit(tmp_path, readings):
    w, alarms, _ = watch(tmp_path, readings, memory_high_watermark_absolute=50 * MiB)
    w.start()
    assert readings["trims"] == 1 and alarms.blocking
    readings["now"] += 1
    w.check()
    assert readings["trims"] == 1                                       # too soon
    readings["now"] += alarm_watch.TRIM_EVERY
    w.check()
    assert readings["trims"] == 2
    readings["rss"] = 10 * MiB
    readings["now"] += alarm_watch.TRIM_EVERY
    w.check()
    assert readings["trims"] == 2 and not alarms.blocking                # below the limit: no trim


def test_a_flood_raises_the_alarm_before_the_watermark_is_crossed(tmp_path, readings, caplog):
    """A flood: readings come every 0.1 s from 80 % of a 100 MiB watermark, and the
    reading at 97 MiB growing 12 MiB per 0.1 s (24 MiB counted) raises the alarm before the RSS is
    above the watermark."""
    caplog.set_level(logging.INFO, "amqpbroker.alarms")
    readings["rss"] = 45 * MiB
    w, alarms, loop = watch(tmp_path, readings, memory_high_watermark_absolute=100 * MiB)
    w.start()
    assert loop.timers[-1][0] == 0.5
    readings["rss"], readings["now"] = 65 * MiB, readings["now"] + 0.5
    w.check()
    assert not alarms.blocking and loop.timers[-1][0] == 0.5
    readings["rss"], readings["now"] = 85 * MiB, readings["now"] + 0.5     # 40 MiB/s, 4 MiB per 0.1 s
    w.check()
    assert not alarms.blocking and loop.timers[-1][0] == 0.1
    readings["rss"], readings["now"] = 97 * MiB, readings["now"] + 0.1     # 120 MiB/s: 12 MiB ahead
    w.check()
    assert alarms.blocking and alarms.memory_used == 97 * MiB and readings["trims"] == 0   # below: no trim
    assert caplog.records[-1].getMessage().startswith(
        "memory alarm raised: broker RSS 97.0 MiB is growing (+24.0 MiB expected by the next check) towards "
        "the high watermark 100.0 MiB")
    readings["rss"], readings["now"] = 96 * MiB, readings["now"] + 0.1
    w.check()
    assert alarms.blocking                                                # clears below 95 MiB only
    readings["rss"], readings["now"] = 94 * MiB, readings["now"] + 0.1
    w.check()
    assert not alarms.blocking


def test_disk_alarm_log_lines_and_no_disk_without_a_store(tmp_path, readings, caplog):
    caplog.set_level(logging.INFO, "amqpbroker.alarms")
    w, _, _ = watch(tmp_path, readings, disk_free_limit=50_000_000)
    readings["free"] = 40_000_000
    w.start()
    line = caplog.records[-1].getMessage()
    assert line == (f"disk alarm raised: 40.0 MB free on the filesystem of {tmp_path}, below disk_free_limit "
                    f"50.0 MB: producers get no credit until 52.5 MB are free (consumers keep draining; free "
                    f"space, or lower the limit: PUT /api/alarms)")
    readings["free"] = 60_000_000
    w.check()
    assert caplog.records[-1].getMessage().startswith("disk alarm cleared: 60.0 MB free")
    no_store = AlarmWatch(FakeLoop(), Alarms(disk_free_limit=10**18, disk_enabled=False), None, 1.0)
    no_store.start()
    assert not no_store.alarms.blocking and no_store.alarms.disk_free is None


def test_an_unreadable_data_dir_keeps_the_disk_alarm_and_warns_once(tmp_path, readings, caplog):
    w, alarms, _ = watch(tmp_path, readings, disk_free_limit=50_000_000)
    readings["free"] = 1
    w.start()
    assert alarms.reasons == ["disk"]
    readings["free"] = None
    w.check()
    w.check()
    assert alarms.reasons == ["disk"]
    assert sum("cannot read the free space" in r.getMessage() for r in caplog.records) == 1


def test_real_readings_of_this_process(tmp_path):
    assert alarm_watch.rss() > 10 * MiB
    assert alarm_watch.physical_memory() > alarm_watch.rss()
    assert 0 < alarm_watch.disk_free(tmp_path)
    assert alarm_watch.disk_free(tmp_path / "missing") is None
    limit = alarm_watch.cgroup_limit(alarm_watch.cgroup_limit_files())
    assert limit is None or limit > 0
