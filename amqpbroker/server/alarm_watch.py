"""Readings for the memory and disk alarms (the decisions are core/alarms.py's).

Every `[alarms] check_interval` (1 s; every 0.1 s once memory is within 80 % of its
watermark), on the event loop: the broker's RSS
(/proc/self/statm: one small read), the memory limit of its cgroup (the files
listed once at start from /proc/self/mountinfo and /proc/self/cgroup: a container's
limit can be changed while it runs, `docker update --memory`), and the free space on
the data dir's filesystem (`os.statvfs`, the blocks available to an unprivileged
user, as `df` shows them).  A check costs tens of microseconds; nothing is read per
message.

Only the broker process's RSS is counted, as RabbitMQ counts its own: the store's
writer process (store/writer.py) stays small (it gives its memory back after each
burst), and page cache of the LMDB map counts in RSS only while mapped pages are
touched (store/maps.py gives those back).

**Freed memory is given back before it counts.**  glibc keeps what Python frees
mapped (it returns only the top of its heaps by itself), so after a backlog drains the
RSS stays near its peak: in bench/alarm_flood.py a broker that had held 120,000 x 1 KiB
stayed at 198 MiB with the queue empty, above a 150 MiB watermark's clear level, and
the alarm would never have cleared.  So whenever a reading is above the watermark (or
not yet below the clear level while raised), the heap is trimmed first (malloc_trim,
~5 ms for that heap; 132 -> 57 MiB in the same case) and RSS read again; at most once
every TRIM_EVERY seconds, and only while memory is at its limit.

Each alarm raised is one WARNING line with its figures and what it means, each one
cleared an INFO line.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable

from ..core.alarms import (
    DISK,
    MEMORY,
    AlarmChange,
    Alarms,
    limit_files,
    lowest_limit,
    memory_decision,
    memory_limit,
    next_check,
    parse_limit,
    parse_mountinfo,
    parse_proc_cgroup,
)
from ..store.maps import trim_heap

log = logging.getLogger("amqpbroker.alarms")

MB = 1_000_000
MiB = 1 << 20
TRIM_EVERY = 5.0          # seconds between heap trims while memory is at its limit


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_limit_files() -> list[str]:
    """The files that may hold this process's cgroup memory limits (own and ancestors')."""
    mountinfo, cgroup = _read("/proc/self/mountinfo"), _read("/proc/self/cgroup")
    if mountinfo is None or cgroup is None:
        return []
    return [f for f in limit_files(parse_mountinfo(mountinfo), parse_proc_cgroup(cgroup)) if os.path.exists(f)]


def cgroup_limit(files: list[str]) -> int | None:
    return lowest_limit(parse_limit(text) for text in map(_read, files) if text is not None)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int | None:
    """The resident set of this process in bytes (now, not the peak)."""
    text = _read("/proc/self/statm")
    if text is not None:
        try:
            return int(text.split()[1]) * _PAGE
        except (IndexError, ValueError):
            pass
    try:   # not Linux: the peak is the best there is (ru_maxrss: KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024
    except (OSError, AttributeError):
        return None


def disk_free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def mb(n: int) -> str:
    """Disk figures in decimal megabytes, as disk_free_limit's default (50 MB) is given."""
    return f"{n:,} bytes" if n < MB else f"{n / MB:,.1f} MB"


def size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < MiB:
        return f"{n:,} bytes"
    return f"{n / MiB:,.1f} MiB" if n < 10 * (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


class AlarmWatch:
    """Feeds `alarms` every `interval` seconds; logs each alarm raised and cleared."""

    def __init__(self, loop: Any, alarms: Alarms, data_dir: Path | None, interval: float,
                 clock: Callable[[], float] = time.monotonic):
        self.loop = loop
        self.alarms = alarms
        self.data_dir = data_dir                  # None: the store is off, so is the disk alarm
        self._where = os.path.abspath(data_dir) if data_dir is not None else ""
        self.interval = interval
        self.clock = clock
        self.physical = physical_memory()
        self._cgroup_files = cgroup_limit_files()
        self._timer: Any = None
        self._disk_unreadable = False
        self._trimmed_at = float("-inf")
        self._last: tuple[float, int | None] | None = None    # (clock, RSS) of the last reading
        self.trims = 0
        self._unobserve = alarms.observe(self._log_change)

    def start(self) -> None:
        """A first check at once: a broker started over its limits raises its alarm before
        the listeners accept anyone."""
        self.check()
        a = self.alarms
        cg = a.cgroup_limit
        log.debug("alarms: memory %s physical, cgroup limit %s (%s); high watermark %s (%s); "
                  "disk_free_limit %s; checked every %g s", size(self.physical), size(cg) if cg else "none",
                  ", ".join(self._cgroup_files) or "no cgroup limit files", size(a.memory_limit), a.memory_basis,
                  mb(a.disk_free_limit) if self.data_dir else "off (no store)", self.interval)

    def check(self) -> None:
        delay = self.interval
        try:
            delay = self._check()
        except Exception:   # a reading must never end the periodic check
            log.exception("alarms: check failed")
        finally:
            self._timer = self.loop.call_later(delay, self.check)

    def _check(self) -> float:
        """Read and feed; returns the seconds to the next check (core/alarms.py
        next_check: sooner near the watermark)."""
        free = None
        if self.data_dir is not None:
            free = disk_free(self.data_dir)
            if free is None and not self._disk_unreadable:
                log.warning("alarms: cannot read the free space of %s; the disk alarm stays as it is "
                            "until it can", self.data_dir)
            self._disk_unreadable = free is None
        cg = cgroup_limit(self._cgroup_files)
        limit = self._limit(cg)
        used = self._rss(limit)
        delay = next_check(self.interval, used, limit)
        self.alarms.feed(rss=used, physical_memory=self.physical or None, cgroup_limit=cg, disk_free=free,
                         rss_ahead=self._growth(used, delay))
        return delay

    def _limit(self, cg: int | None) -> int | None:
        a = self.alarms
        if a.memory_high_watermark_absolute is None and not self.physical:
            return None
        return memory_limit(self.physical, cg, a.memory_high_watermark, a.memory_high_watermark_absolute)

    def _growth(self, used: int | None, delay: float) -> int:
        """The RSS growth to count on before the next reading: the rate since the last
        reading, carried on for `delay` seconds, twice over (0 when shrinking or
        unknown).  Twice: credit granted before the alarm still brings messages in after
        it (bench/alarm_flood.py: raised at 255.5 MiB with 3.7 MiB expected, the RSS
        still rose 1.5 MiB)."""
        now = self.clock()
        last, self._last = self._last, (now, used)
        if used is None or last is None or last[1] is None or now <= last[0]:
            return 0
        rate = (used - last[1]) / (now - last[0])
        return int(2 * rate * delay) if rate > 0 else 0

    def _rss(self, limit: int | None) -> int | None:
        """The RSS, after giving malloc's free memory back when it is at the limit."""
        used = rss()
        if limit is None or used is None or not memory_decision(self.alarms.raised(MEMORY), used, limit):
            return used
        now = self.clock()
        if now - self._trimmed_at < TRIM_EVERY:
            return used
        self._trimmed_at = now
        trim_heap()
        self.trims += 1
        after = rss()
        log.debug("alarms: RSS %s at the memory limit %s: heap trimmed in %.1f ms, RSS now %s", size(used),
                  size(limit), (self.clock() - now) * 1000, size(after))
        return after

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unobserve()

    # ------------------------------------------------------------------ log lines

    def _log_change(self, c: AlarmChange) -> None:
        a = self.alarms
        if c.kind == DISK:
            where = f"the filesystem of {self._where}"
            if c.raised:
                log.warning("disk alarm raised: %s free on %s, below disk_free_limit %s: producers get "
                            "no credit until %s are free (consumers keep draining; free space, or lower "
                            "the limit: PUT /api/alarms)", mb(c.value), where, mb(c.limit), mb(c.clear_at))
            else:
                log.info("disk alarm cleared: %s free on %s (limit %s): producers get credit again%s",
                         mb(c.value), where, mb(c.limit), self._still(a))
            return
        if a.memory_basis == "absolute":
            basis = "memory_high_watermark_absolute"
        else:
            basis = (f"{a.memory_high_watermark:g} of {size(a.memory_total)} "
                     f"{'cgroup limit' if a.memory_basis == 'cgroup' else 'physical memory'}")
        if c.raised:
            where = ("is above" if c.value > c.limit else
                     f"is growing (+{size(c.ahead)} expected by the next check) towards")
            log.warning("memory alarm raised: broker RSS %s %s the high watermark %s (%s): producers get "
                        "no credit until it falls below %s (consumers keep draining)",
                        size(c.value), where, size(c.limit), basis, size(c.clear_at))
        else:
            log.info("memory alarm cleared: broker RSS %s, below %s (high watermark %s): producers get credit "
                     "again%s", size(c.value), size(c.clear_at), size(c.limit), self._still(a))

    @staticmethod
    def _still(a: Alarms) -> str:
        return f" once the {', '.join(a.reasons)} alarm clears too" if a.blocking else ""


__all__ = ["AlarmWatch", "cgroup_limit", "cgroup_limit_files", "disk_free", "physical_memory", "rss"]
