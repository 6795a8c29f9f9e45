"""Memory and disk alarms (core/alarms.py): decisions row by row, hysteresis,
callbacks, the memory limit and the cgroup files it is read from."""

from __future__ import annotations

import pytest

from amqpbroker.core.alarms import (
    DISK,
    MEMORY,
    NEAR_INTERVAL,
    AlarmChange,
    Alarms,
    CgroupMount,
    disk_decision,
    limit_files,
    lowest_limit,
    memory_decision,
    memory_limit,
    next_check,
    parse_bytes,
    parse_limit,
    parse_mountinfo,
    parse_proc_cgroup,
)

GiB = 1 << 30
MB = 1_000_000


# ---------------------------------------------------------------------- decisions

@pytest.mark.parametrize("raised, used, limit, after", [
    (False, 99, 100, False),       # below
    (False, 100, 100, False),      # at the watermark: not above it (RabbitMQ: used > limit)
    (False, 101, 100, True),       # above: raised
    (True, 101, 100, True),
    (True, 99, 100, True),         # below the watermark but within the 5 % margin: still raised
    (True, 95, 100, True),         # at 0.95 x: still raised
    (True, 94, 100, False),        # below 0.95 x: cleared
    (False, 96, 100, False),       # the margin applies to clearing only
])
def test_memory_decision(raised, used, limit, after):
    assert memory_decision(raised, used, limit) is after


@pytest.mark.parametrize("raised, used, ahead, after", [
    (False, 96, 4, False),         # still not above after the expected growth
    (False, 96, 5, True),          # would be above by the next reading: raised now
    (False, 95, 6, True),          # from the clear level up
    (False, 94, 50, False),        # below it, the next reading would clear it: not raised
    (False, 99, -50, False),       # shrinking: counts as no growth
    (False, 101, -50, True),       # above is above, whatever the trend
    (True, 94, 50, False),         # clearing looks at the reading alone
])
def test_memory_decision_looks_ahead_when_raising(raised, used, ahead, after):
    assert memory_decision(raised, used, 100, ahead) is after


@pytest.mark.parametrize("used, limit, delay", [
    (None, 100, 1.0), (50, None, 1.0),   # nothing known: the configured interval
    (79, 100, 1.0),                      # far from the watermark
    (80, 100, NEAR_INTERVAL),            # within 80 %: read often
    (120, 100, NEAR_INTERVAL),
])
def test_next_check_is_sooner_near_the_watermark(used, limit, delay):
    assert next_check(1.0, used, limit) == delay
    assert next_check(0.05, used, limit) == 0.05    # a shorter interval stays


def test_feed_raises_on_the_growth_expected_before_the_next_reading():
    a, blocking, changes = fed(memory_high_watermark_absolute=100)
    a.feed(rss=90, rss_ahead=50)
    assert not a.blocking
    a.feed(rss=96, rss_ahead=10)
    assert a.blocking and (changes[-1].value, changes[-1].ahead) == (96, 10) and blocking == [True]


@pytest.mark.parametrize("raised, free, limit, after", [
    (False, 51 * MB, 50 * MB, False),
    (False, 50 * MB, 50 * MB, False),     # at the limit: not below it
    (False, 49 * MB, 50 * MB, True),
    (True, 51 * MB, 50 * MB, True),       # within the margin: still raised
    (True, 52_499_999, 50 * MB, True),
    (True, 52_500_000, 50 * MB, False),   # 1.05 x the limit free: cleared
    (False, 0, 0, False),                 # limit 0: never raised (off)
])
def test_disk_decision(raised, free, limit, after):
    assert disk_decision(raised, free, limit) is after


# ---------------------------------------------------------------------- the memory limit

@pytest.mark.parametrize("physical, cgroup, fraction, absolute, limit", [
    (10 * GiB, None, 0.4, None, 4 * GiB),          # RabbitMQ's default: 0.4 of physical memory
    (10 * GiB, 2 * GiB, 0.4, None, int(0.8 * GiB)),  # a container's limit when lower
    (10 * GiB, 20 * GiB, 0.5, None, 5 * GiB),      # a cgroup limit above physical memory changes nothing
    (10 * GiB, 2 * GiB, 0.4, 123, 123),            # absolute bytes replace the fraction
    (10 * GiB, None, 1.0, None, 10 * GiB),
])
def test_memory_limit(physical, cgroup, fraction, absolute, limit):
    assert memory_limit(physical, cgroup, fraction, absolute) == limit


# ---------------------------------------------------------------------- Alarms

def fed(**kw) -> tuple[Alarms, list, list]:
    a = Alarms(**kw)
    blocking, changes = [], []
    a.subscribe(blocking.append)
    a.observe(changes.append)
    return a, blocking, changes


def test_defaults_and_nothing_raised_before_readings():
    a = Alarms()
    assert (a.memory_high_watermark, a.memory_high_watermark_absolute, a.disk_free_limit) == (0.4, None, 50 * MB)
    assert not a.blocking and a.reasons == [] and a.memory_limit is None
    assert a.feed() == [] and not a.blocking


def test_memory_raised_then_cleared_with_hysteresis():
    a, blocking, changes = fed()
    a.feed(rss=3 * GiB, physical_memory=10 * GiB)                   # limit 4 GiB
    assert not a.blocking and a.memory_limit == 4 * GiB and a.memory_basis == "physical"
    out = a.feed(rss=4 * GiB + 1)
    assert out == changes == [AlarmChange(MEMORY, True, 4 * GiB + 1, 4 * GiB, int(4 * GiB * 0.95), True)]
    assert a.blocking and a.reasons == ["memory"] and blocking == [True]
    assert a.feed(rss=4 * GiB - 1) == [] and a.blocking             # below, within the margin
    assert a.feed(rss=int(3.9 * GiB)) == [] and a.blocking
    out = a.feed(rss=int(3.7 * GiB))
    assert [(c.kind, c.raised, c.blocking) for c in out] == [(MEMORY, False, False)]
    assert not a.blocking and blocking == [True, False] and a.raised_total == {MEMORY: 1, DISK: 0}


def test_readings_not_made_keep_the_last_ones():
    a, _, _ = fed(memory_high_watermark_absolute=100)
    a.feed(rss=200)
    assert a.blocking
    a.feed(rss=None, disk_free=None)
    assert a.blocking and a.memory_used == 200


def test_the_cgroup_limit_sets_the_memory_limit_when_lower():
    a, _, _ = fed(memory_high_watermark=0.5)
    a.feed(rss=1 * GiB, physical_memory=16 * GiB, cgroup_limit=2 * GiB)
    assert a.memory_total == 2 * GiB and a.memory_basis == "cgroup" and a.memory_limit == GiB
    assert not a.blocking
    a.feed(rss=1 * GiB + 1, physical_memory=16 * GiB, cgroup_limit=2 * GiB)
    assert a.blocking
    a.feed(physical_memory=16 * GiB, cgroup_limit=None)             # the limit lifted (docker update)
    assert a.memory_basis == "physical" and not a.blocking


def test_disk_raised_and_cleared():
    a, blocking, changes = fed(disk_free_limit=50 * MB)
    a.feed(disk_free=60 * MB)
    assert not a.blocking
    a.feed(disk_free=49 * MB)
    assert a.reasons == ["disk"] and blocking == [True]
    assert changes[-1] == AlarmChange(DISK, True, 49 * MB, 50 * MB, 52_500_000, True)
    a.feed(disk_free=51 * MB)
    assert a.blocking
    a.feed(disk_free=53 * MB)
    assert not a.blocking and blocking == [True, False]


def test_disk_alarm_off_without_a_store():
    a, blocking, _ = fed(disk_free_limit=10**18, disk_enabled=False)
    a.feed(disk_free=1)
    assert not a.blocking and a.disk_free is None and blocking == []


def test_blocking_changes_once_for_two_alarms():
    a, blocking, changes = fed(memory_high_watermark_absolute=100, disk_free_limit=50)
    a.feed(rss=200, disk_free=10)
    assert a.reasons == ["memory", "disk"] and blocking == [True]
    assert [(c.kind, c.raised) for c in changes] == [(MEMORY, True), (DISK, True)]
    a.feed(rss=10)                                    # memory clears; disk still raised
    assert a.reasons == ["disk"] and blocking == [True] and changes[-1].blocking is True
    a.feed(disk_free=1000)
    assert a.reasons == [] and blocking == [True, False] and changes[-1].blocking is False


def test_configure_decides_again_on_the_last_readings():
    a, blocking, _ = fed()
    a.feed(rss=100 * MB, physical_memory=10 * GiB, disk_free=10 * GiB)
    assert not a.blocking
    a.configure(memory_high_watermark_absolute=1)                   # tests: 1 byte raises at once
    assert a.reasons == ["memory"] and a.memory_basis == "absolute"
    a.configure(disk_free_limit=10**15)                             # more than the disk: raised at once
    assert a.reasons == ["memory", "disk"]
    a.configure(memory_high_watermark_absolute=None)                # back to the fraction (4 GiB)
    a.configure(disk_free_limit=1)
    assert a.reasons == [] and blocking == [True, False]
    a.configure(memory_high_watermark=0.001)                        # 10.7 MB: raised
    assert a.reasons == ["memory"] and a.memory_high_watermark == 0.001


@pytest.mark.parametrize("kw", [
    {"memory_high_watermark": 0}, {"memory_high_watermark": 1.5}, {"memory_high_watermark_absolute": 0},
    {"disk_free_limit": -1},
])
def test_configure_refuses_bad_thresholds_and_changes_nothing(kw):
    a = Alarms(memory_high_watermark=0.5, disk_free_limit=7)
    with pytest.raises(ValueError):
        a.configure(**{"memory_high_watermark_absolute": 5, "disk_free_limit": 9, **kw})   # one bad: none taken
    assert (a.memory_high_watermark, a.memory_high_watermark_absolute, a.disk_free_limit) == (0.5, None, 7)


def test_callbacks_unsubscribe_and_a_failing_one_does_not_stop_the_others(caplog):
    a = Alarms(memory_high_watermark_absolute=100)
    seen: list = []

    def bad(blocking: bool) -> None:
        raise RuntimeError("boom")

    a.subscribe(bad)
    stop = a.subscribe(seen.append)
    a.feed(rss=200)
    assert seen == [True] and "alarm callback" in caplog.text
    stop()
    a.feed(rss=1)
    assert seen == [True] and not a.blocking
    stop()                                                          # twice: harmless


# ---------------------------------------------------------------------- cgroups

MOUNTINFO_HYBRID = """\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
29 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
30 29 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 29 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,memory
36 29 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,cpu,cpuacct
"""

PROC_CGROUP_HYBRID = """\
9:name=systemd:/
4:memory:/process_api/e6f1
2:cpu,cpuacct:/
0::/
"""


def test_mountinfo_cgroup_mounts():
    assert parse_mountinfo(MOUNTINFO_HYBRID) == [CgroupMount(2, "/sys/fs/cgroup/unified", "/"),
                                                 CgroupMount(1, "/sys/fs/cgroup/memory", "/")]
    # A container without its own cgroup namespace sees its cgroup mounted as the root,
    # and a path with a space is escaped.
    text = r"51 40 0:29 /docker/abc /sys/fs/my\040cgroup ro,nosuid - cgroup2 cgroup rw" + "\nnot a line\n"
    assert parse_mountinfo(text) == [CgroupMount(2, "/sys/fs/my cgroup", "/docker/abc")]


def test_proc_self_cgroup():
    assert parse_proc_cgroup(PROC_CGROUP_HYBRID) == {2: "/", 1: "/process_api/e6f1"}
    assert parse_proc_cgroup("0::/system.slice/broker.service\n") == {2: "/system.slice/broker.service"}
    assert parse_proc_cgroup("garbage\n5:cpu,memory:/x\n") == {1: "/x"}


def test_limit_files_own_cgroup_then_ancestors():
    mounts = parse_mountinfo(MOUNTINFO_HYBRID)
    assert limit_files(mounts, parse_proc_cgroup(PROC_CGROUP_HYBRID)) == [
        "/sys/fs/cgroup/unified/memory.max",
        "/sys/fs/cgroup/memory/process_api/e6f1/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    v2 = [CgroupMount(2, "/sys/fs/cgroup", "/")]
    assert limit_files(v2, {2: "/kubepods/pod1/c1"}) == [
        "/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "/sys/fs/cgroup/kubepods/pod1/memory.max",
        "/sys/fs/cgroup/kubepods/memory.max", "/sys/fs/cgroup/memory.max"]


def test_limit_files_when_the_mount_shows_a_part_of_the_hierarchy():
    # Docker without a cgroup namespace: the container's cgroup is the mount's root.
    mounts = [CgroupMount(2, "/sys/fs/cgroup", "/docker/abc")]
    assert limit_files(mounts, {2: "/docker/abc"}) == ["/sys/fs/cgroup/memory.max"]
    assert limit_files(mounts, {2: "/docker/abc/sub"}) == ["/sys/fs/cgroup/sub/memory.max",
                                                          "/sys/fs/cgroup/memory.max"]
    assert limit_files(mounts, {2: "/elsewhere"}) == []      # not under this mount
    assert limit_files(mounts, {1: "/docker/abc"}) == []     # no v2 path


@pytest.mark.parametrize("text, limit", [
    ("max\n", None),                                  # v2: no limit
    ("536870912\n", 536870912),
    ("9223372036854771712\n", None),                  # v1: no limit
    ("", None), ("garbage", None), ("0", None),
])
def test_parse_limit(text, limit):
    assert parse_limit(text) == limit


def test_lowest_limit_binds():
    assert lowest_limit([None, 4 * GiB, 2 * GiB]) == 2 * GiB
    assert lowest_limit([None, None]) is None and lowest_limit([]) is None


# ---------------------------------------------------------------------- byte sizes

@pytest.mark.parametrize("value, n", [
    (50_000_000, 50_000_000), ("50MB", 50_000_000), ("50 mb", 50_000_000), ("512MiB", 512 << 20),
    ("2GB", 2_000_000_000), ("1.5GiB", 3 << 29), ("1024", 1024), ("10kB", 10_000),
])
def test_parse_bytes(value, n):
    assert parse_bytes(value) == n


@pytest.mark.parametrize("value", ["lots", "5 parsecs", "-3MB", True, ""])
def test_parse_bytes_refuses(value):
    with pytest.raises(ValueError):
        parse_bytes(value)
