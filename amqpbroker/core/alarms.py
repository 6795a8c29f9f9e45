"""Broker-wide resource alarms: memory and disk (pure: no I/O, no clock).

RabbitMQ's model (https://www.rabbitmq.com/docs/alarms, /memory, /disk-alarms): when
the broker's memory use goes above a high watermark, or the free space on the disk
holding its data goes below a limit, an alarm is raised and publishers are blocked
until it clears; consumers keep draining, which is how the broker gets out of it.
Here "blocked" means producers get no new link credit (AMQP 1.0 §2.6.7: credit is the
receiver's permission to send); nothing is refused or closed.  Subscribers to
`Alarms.subscribe` (the producers' credit) are told whenever `blocking` changes.

`Alarms` is fed readings (server/alarm_watch.py reads them every
`[alarms] check_interval`) and decides:

* memory: raised when the broker's RSS is above the limit; cleared once it is below
  `MEMORY_CLEAR_RATIO` x the limit.  The limit is `memory_high_watermark` (a fraction,
  default 0.4 as RabbitMQ's vm_memory_high_watermark) of the memory available to the
  process: the physical memory, or the cgroup's limit when lower (a container);
  `memory_high_watermark_absolute` (bytes) replaces it.
* disk: raised when the free space on the data dir's filesystem is below
  `disk_free_limit` (default 50 MB, RabbitMQ's default); cleared once it is at least
  `DISK_CLEAR_RATIO` x the limit.  Off when the store is (nothing is written).

**Raised before the watermark is crossed, not after.**  Readings come every
`check_interval`; a producer flooding a queue grows the RSS by tens of MiB a second
(bench/alarm_flood.py: 36 MiB/s of 1 KiB messages), so an alarm raised on the first
reading above the line leaves the broker that far above it.  The watch passes the
growth it expects before its next reading (`ahead`: the rate between its last two
readings x the time to the next), and the alarm is raised when the RSS *would* be
above the watermark by then; and near the watermark (`NEAR_RATIO`) it reads every
`NEAR_INTERVAL`.  Clearing looks at the reading alone.

The margins keep an alarm from flapping: a broker hovering at its watermark would
otherwise block and unblock producers every check, each unblock letting a burst in
(RabbitMQ has no margin and documents that flapping).

The cgroup parsing below (/proc/self/mountinfo, /proc/self/cgroup, memory.max,
memory.limit_in_bytes) is pure too: server/alarm_watch.py reads the files.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import EllipsisType
from typing import Callable, Iterable

from .numbers import ascii_int

log = logging.getLogger("amqpbroker.alarms")

MEMORY = "memory"
DISK = "disk"
KINDS = (MEMORY, DISK)

DEFAULT_MEMORY_HIGH_WATERMARK = 0.4            # RabbitMQ's vm_memory_high_watermark default
DEFAULT_DISK_FREE_LIMIT = 50_000_000           # RabbitMQ's disk_free_limit default (50 MB)
MEMORY_CLEAR_RATIO = 0.95                      # memory clears below 95 % of the limit
NEAR_RATIO = 0.8                               # from 80 % of the limit, memory is read ...
NEAR_INTERVAL = 0.1                            # ... at least every 0.1 s
DISK_CLEAR_RATIO = 1.05                        # disk clears at 105 % of the limit free

# cgroup v1 writes "no limit" as the largest page-aligned counter value
# (9223372036854771712 with 4 KiB pages); anything this large is no limit.
CGROUP_NO_LIMIT = 1 << 62


# ---------------------------------------------------------------------- the memory limit

def memory_available(physical: int, cgroup_limit: int | None) -> tuple[int, str]:
    """The memory the process may use, and what sets it ("physical" or "cgroup")."""
    if cgroup_limit is not None and cgroup_limit < physical:
        return cgroup_limit, "cgroup"
    return physical, "physical"


def memory_limit(physical: int, cgroup_limit: int | None, fraction: float,
                 absolute: int | None = None) -> int:
    """The memory high watermark in bytes: `absolute` when configured, else `fraction`
    of min(physical memory, cgroup limit)."""
    if absolute is not None:
        return absolute
    available, _ = memory_available(physical, cgroup_limit)
    return int(available * fraction)


# ---------------------------------------------------------------------- cgroups

@dataclass(frozen=True)
class CgroupMount:
    version: int          # 1 (the v1 memory controller's hierarchy) or 2 (the unified one)
    mount_point: str      # where it is mounted, e.g. /sys/fs/cgroup
    root: str             # the cgroup shown at the mount point ("/" unless a container's view)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup v2 mounts and cgroup v1 memory-controller mounts in /proc/self/mountinfo
    (proc(5): `id parent major:minor root mount-point options [optional…] - fstype source
    super-options`)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        fstype = tail[0]
        if fstype == "cgroup2":
            out.append(CgroupMount(2, _unescape(fields[4]), _unescape(fields[3])))
        elif fstype == "cgroup" and len(tail) >= 3 and "memory" in tail[2].split(","):
            out.append(CgroupMount(1, _unescape(fields[4]), _unescape(fields[3])))
    return out


def parse_proc_cgroup(text: str) -> dict[int, str]:
    """The process's cgroup paths from /proc/self/cgroup (cgroups(7)): {2: path of the
    unified hierarchy ("0::/path"), 1: path in the v1 memory hierarchy}."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out[2] = path
        elif "memory" in controllers.split(","):
            out[1] = path
    return out


def limit_files(mounts: Iterable[CgroupMount], cgroups: dict[int, str]) -> list[str]:
    """Files that may hold a memory limit of the process: its own cgroup's and every
    ancestor's up to the mount point (a parent's limit binds its children too), for v2
    (`memory.max`) and v1 (`memory.limit_in_bytes`).  Files that do not exist are
    skipped by the reader (the root cgroup has none)."""
    out: list[str] = []
    for m in mounts:
        path = cgroups.get(m.version)
        if path is None:
            continue
        root = m.root.rstrip("/")
        if root and path != root and not path.startswith(root + "/"):
            continue                      # this mount shows another part of the hierarchy
        rel = path[len(root):].strip("/")
        name = "memory.max" if m.version == 2 else "memory.limit_in_bytes"
        parts = rel.split("/") if rel else []
        base = m.mount_point.rstrip("/")
        for depth in range(len(parts), -1, -1):
            out.append("/".join([base, *parts[:depth], name]))
    return out


def parse_limit(text: str) -> int | None:
    """A memory.max / memory.limit_in_bytes value: bytes, or None for no limit ("max",
    v1's huge number, or anything unreadable)."""
    n = ascii_int(text.strip())
    if n is None:
        return None                       # "max" (v2), or garbage
    return None if n >= CGROUP_NO_LIMIT or n == 0 else n


def lowest_limit(values: Iterable[int | None]) -> int | None:
    limits = [v for v in values if v is not None]
    return min(limits) if limits else None


# ---------------------------------------------------------------------- byte sizes

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """A byte count: an int, or text such as "50MB", "512MiB", "2GB" (decimal kB/MB/GB
    as RabbitMQ's disk_free_limit, binary KiB/MiB/GiB)."""
    if isinstance(value, bool):
        raise ValueError("a byte count, e.g. 50000000 or \"50MB\"")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ValueError(f"'{value}' is not a byte count (e.g. 50000000, \"50MB\", \"512MiB\", \"2GB\")")
    return int(float(m.group(1)) * unit)


# ---------------------------------------------------------------------- the alarms

@dataclass(frozen=True)
class AlarmChange:
    """One alarm raised or cleared, with the figures that decided it."""
    kind: str             # MEMORY | DISK
    raised: bool
    value: int            # memory: RSS bytes; disk: free bytes
    limit: int            # memory: the high watermark; disk: disk_free_limit
    clear_at: int         # memory: clears below this; disk: clears from this many bytes free
    blocking: bool        # whether any alarm is raised after this change
    ahead: int = 0        # memory raised: the growth expected before the next reading


def memory_decision(raised: bool, used: int, limit: int, ahead: int = 0) -> bool:
    """Whether the memory alarm is raised after a reading (hysteresis: see the module).
    `ahead`: the growth expected before the next reading; from the clear level up, the
    alarm is raised when the RSS would be above the watermark by then (a shrinking RSS
    does not count).  Not below the clear level: the next reading would clear it, and
    producers would be blocked and unblocked at every reading."""
    clear_at = limit * MEMORY_CLEAR_RATIO
    if raised:
        return used >= clear_at
    return used > limit or (used >= clear_at and used + max(ahead, 0) > limit)


def next_check(interval: float, used: int | None, limit: int | None) -> float:
    """Seconds to the next reading: `interval`, or `NEAR_INTERVAL` once memory is
    within reach of its watermark (reading /proc/self/statm costs microseconds)."""
    if used is None or limit is None or used < limit * NEAR_RATIO:
        return interval
    return min(interval, NEAR_INTERVAL)


def disk_decision(raised: bool, free: int, limit: int) -> bool:
    if raised:
        return free < limit * DISK_CLEAR_RATIO
    return free < limit


class Alarms:
    """The alarm state of one broker.  Readings come in through `feed`, thresholds
    through `configure` (config at start, `PUT /api/alarms` at run time); both
    re-decide at once and tell the observers (`observe`: every alarm raised or
    cleared, for the log) and the subscribers (`subscribe`: `blocking` changed)."""

    def __init__(self, memory_high_watermark: float = DEFAULT_MEMORY_HIGH_WATERMARK,
                 memory_high_watermark_absolute: int | None = None,
                 disk_free_limit: int = DEFAULT_DISK_FREE_LIMIT, *, disk_enabled: bool = True):
        self.memory_high_watermark = DEFAULT_MEMORY_HIGH_WATERMARK
        self.memory_high_watermark_absolute: int | None = None
        self.disk_free_limit = DEFAULT_DISK_FREE_LIMIT
        self.disk_enabled = disk_enabled
        self.memory_used: int | None = None      # last readings (None: none yet)
        self.memory_ahead = 0                     # growth expected before the next reading
        self.physical_memory: int | None = None
        self.cgroup_limit: int | None = None
        self.disk_free: int | None = None
        self.raised_total = {kind: 0 for kind in KINDS}
        self._raised: dict[str, bool] = {kind: False for kind in KINDS}
        self._subscribers: list[Callable[[bool], None]] = []
        self._observers: list[Callable[[AlarmChange], None]] = []
        self.configure(memory_high_watermark=memory_high_watermark,
                       memory_high_watermark_absolute=memory_high_watermark_absolute,
                       disk_free_limit=disk_free_limit)

    # ------------------------------------------------------------------ state

    @property
    def blocking(self) -> bool:
        """True while any alarm is raised: producers get no new credit."""
        return any(self._raised.values())

    @property
    def reasons(self) -> list[str]:
        """The raised alarms, e.g. ["memory", "disk"] (empty when none)."""
        return [kind for kind in KINDS if self._raised[kind]]

    def raised(self, kind: str) -> bool:
        return self._raised[kind]

    @property
    def memory_total(self) -> int | None:
        """The memory available to the process (physical, or the cgroup's limit)."""
        if self.physical_memory is None:
            return None
        return memory_available(self.physical_memory, self.cgroup_limit)[0]

    @property
    def memory_basis(self) -> str:
        """What sets the memory limit: "absolute", "cgroup" or "physical"."""
        if self.memory_high_watermark_absolute is not None:
            return "absolute"
        if self.physical_memory is None:
            return "physical"
        return memory_available(self.physical_memory, self.cgroup_limit)[1]

    @property
    def memory_limit(self) -> int | None:
        """The high watermark in bytes (None until the memory size is known, unless absolute)."""
        if self.memory_high_watermark_absolute is None and self.physical_memory is None:
            return None
        return memory_limit(self.physical_memory or 0, self.cgroup_limit, self.memory_high_watermark,
                            self.memory_high_watermark_absolute)

    def clear_at(self, kind: str) -> int | None:
        if kind == MEMORY:
            limit = self.memory_limit
            return None if limit is None else int(limit * MEMORY_CLEAR_RATIO)
        return int(self.disk_free_limit * DISK_CLEAR_RATIO)

    # ------------------------------------------------------------------ callbacks

    def subscribe(self, callback: Callable[[bool], None]) -> Callable[[], None]:
        """`callback(blocking)` each time `blocking` changes (not on every reading).
        Returns a function that unsubscribes it."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def observe(self, callback: Callable[[AlarmChange], None]) -> Callable[[], None]:
        """`callback(change)` for each alarm raised or cleared."""
        self._observers.append(callback)
        return lambda: self._observers.remove(callback) if callback in self._observers else None

    # ------------------------------------------------------------------ inputs

    def configure(self, *, memory_high_watermark: float | None = None,
                  memory_high_watermark_absolute: int | None | EllipsisType = ...,
                  disk_free_limit: int | None = None) -> list[AlarmChange]:
        """Change thresholds (None / left out: unchanged; the absolute watermark takes
        None to return to the fraction), then decide again on the last readings."""
        if memory_high_watermark is not None and not 0 < memory_high_watermark <= 1:
            raise ValueError("memory_high_watermark must be a fraction of memory: 0 < x <= 1")
        if memory_high_watermark_absolute is not ... and memory_high_watermark_absolute is not None \
                and memory_high_watermark_absolute < 1:
            raise ValueError("memory_high_watermark_absolute must be at least 1 byte")
        if disk_free_limit is not None and disk_free_limit < 0:
            raise ValueError("disk_free_limit must be 0 or more bytes")
        if memory_high_watermark is not None:
            self.memory_high_watermark = float(memory_high_watermark)
        if memory_high_watermark_absolute is not ...:
            self.memory_high_watermark_absolute = memory_high_watermark_absolute
        if disk_free_limit is not None:
            self.disk_free_limit = int(disk_free_limit)
        return self._decide()

    def feed(self, *, rss: int | None = None, physical_memory: int | None = None,
             cgroup_limit: int | None = None, disk_free: int | None = None,
             rss_ahead: int = 0) -> list[AlarmChange]:
        """New readings (None: not read this time, the last one stands; except
        `cgroup_limit`, where None is "no limit" and is taken as given with
        `physical_memory`), then decide.  `rss_ahead`: how much the RSS is expected
        to grow before the next reading (see the module)."""
        if rss is not None:
            self.memory_used = rss
            self.memory_ahead = rss_ahead
        if physical_memory is not None:
            self.physical_memory = physical_memory
            self.cgroup_limit = cgroup_limit
        if disk_free is not None and self.disk_enabled:
            self.disk_free = disk_free
        return self._decide()

    # ------------------------------------------------------------------ deciding

    def _decide(self) -> list[AlarmChange]:
        was_blocking = self.blocking
        changes = []
        limit = self.memory_limit
        if self.memory_used is not None and limit is not None:
            now = memory_decision(self._raised[MEMORY], self.memory_used, limit, self.memory_ahead)
            if now != self._raised[MEMORY]:
                changes.append(self._change(MEMORY, now, self.memory_used, limit))
        if self.disk_enabled and self.disk_free is not None:
            now = disk_decision(self._raised[DISK], self.disk_free, self.disk_free_limit)
            if now != self._raised[DISK]:
                changes.append(self._change(DISK, now, self.disk_free, self.disk_free_limit))
        if self.blocking != was_blocking:
            self._notify(self._subscribers, self.blocking)
        return changes

    def _change(self, kind: str, raised: bool, value: int, limit: int) -> AlarmChange:
        """One alarm changes; its observers are told at once, so that what they read
        (`reasons`, `blocking`) is the state right after this change."""
        self._raised[kind] = raised
        if raised:
            self.raised_total[kind] += 1
        ahead = self.memory_ahead if kind == MEMORY and raised else 0
        change = AlarmChange(kind, raised, value, limit, self.clear_at(kind) or 0, self.blocking, ahead)
        self._notify(self._observers, change)
        return change

    @staticmethod
    def _notify(callbacks: list, arg: object) -> None:
        # One failing callback must not keep the others (producers' credit) uninformed.
        for callback in list(callbacks):
            try:
                callback(arg)
            except Exception:
                log.exception("alarm callback %r failed", callback)


__all__ = ["AlarmChange", "Alarms", "CgroupMount", "DISK", "KINDS", "MEMORY", "limit_files", "lowest_limit",
           "memory_available", "memory_limit", "next_check", "parse_bytes", "parse_limit", "parse_mountinfo",
           "parse_proc_cgroup"]
