"""Rebuilding the topic log's index at start-up (pure; core/topiclog.py).

Input: the log records as scanned from the store (position, route, size, plus,
minus; no bodies), the routes, and the members with their cursors.  Output: the
index (route and owing count per position), each member's backlog (count and
bytes of what it owes and has not settled: its paged region), the records no
member owes any more (to delete) and how many owed positions come back counted
as redelivered.

The work is O(records + members x their routes), not O(records x members): a
member's rule covers its positions from max(floor, joined) to where it left, so
per route its backlog is a difference of two bisections over the route's
positions, and the owing counts are a running sum over those intervals.  Only the
exceptions (plus, minus) and the settled ranges above a floor are visited one by one.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .topiclog import Member, TopicLog

LogRow = tuple  # (position, route id, size, plus frozenset, minus frozenset, ...more ignored)


@dataclass
class Rebuilt:
    backlog: dict[int, tuple[int, int]] = field(default_factory=dict)   # queue id -> (entries, bytes)
    orphans: list[int] = field(default_factory=list)                    # records nobody owes
    redelivered: int = 0                                                # owed positions up to a watermark


def rebuild(log: TopicLog, rows: Iterable[LogRow], *, marks: dict[int, int] | None = None,
            takers: Callable[[int], Iterable[int]] | None = None) -> Rebuilt:
    """Index `rows` (in position order) into `log`, whose routes and members (with
    their cursors) are in place.  `marks`: queue id -> the delivery watermark found
    (for the redelivered count); `takers(rid)`: the members whose rule takes a route
    (default: asked of every member)."""
    marks = marks or {}
    out = Rebuilt()
    rows = list(rows)
    positions: dict[int, list[int]] = {}
    sizes: dict[int, list[int]] = {}
    size_at: dict[int, int] = {}
    if rows:
        first, last = rows[0][0], rows[-1][0]
        log.start = first
        log._free_head = 0
        n = last - first + 1
        log.route_of = array("I", bytes(4 * n))
        log.owing = array("q", bytes(8 * n))   # signed while counts go up and down
        log.positions.last = max(log.positions.last, last)
    else:
        log.start = log.positions.last + 1
    for row in rows:
        pos, rid, size, plus, minus = row[:5]
        i = pos - log.start
        log.route_of[i] = rid
        if plus or minus:
            log.exceptions[pos] = (plus, minus)
        log.route_refs[rid] = log.route_refs.get(rid, 0) + 1
        log.records += 1
        positions.setdefault(rid, []).append(pos)
        sizes.setdefault(rid, []).append(size)
        size_at[pos] = size
    members = log.members
    backlog = {qid: [0, 0] for qid in members}
    for rid, ps in positions.items():
        _by_rule(log, rid, ps, sizes[rid], takers, backlog, marks, out)
    for pos, (plus, minus) in log.exceptions.items():
        _exceptions(log, pos, plus, minus, size_at[pos], backlog, marks, out)
    for qid, m in members.items():
        _ranges(log, m, size_at, backlog[qid], marks.get(qid, 0), out)
    log.owing = array("I", (max(0, k) for k in log.owing))
    out.orphans = [row[0] for row in rows if not log.owing[row[0] - log.start]]
    for pos in out.orphans:   # (releasing one may cut the head of the index: positions, not slots)
        log.owing[pos - log.start] = 1
        log._release(pos)
    out.backlog = {qid: (c, b) for qid, (c, b) in backlog.items()}
    return out


def _by_rule(log: TopicLog, rid: int, ps: list[int], size_list: list[int],
             takers: Callable[[int], Iterable[int]] | None, backlog: dict, marks: dict, out: Rebuilt) -> None:
    route = log.routes.get(rid)
    if route is None:
        return
    members = log.members
    if takers is None:
        who = [m for m in members.values() if m.takes(rid, route)]
    else:
        who = [members[q] for q in takers(rid) if q in members and members[q].takes(rid, route)]
    if not who:
        return
    pre = [0]
    for s in size_list:
        pre.append(pre[-1] + s)
    diff = [0] * (len(ps) + 1)
    for m in who:
        c = m.cursor
        i = bisect_left(ps, max(c.floor, c.joined))
        j = len(ps) if c.left is None else bisect_left(ps, c.left)
        if i >= j:
            continue
        diff[i] += 1
        diff[j] -= 1
        acc = backlog[m.queue_id]
        acc[0] += j - i
        acc[1] += pre[j] - pre[i]
        w = marks.get(m.queue_id, 0)
        if w:
            out.redelivered += max(0, min(j, bisect_right(ps, w)) - i)
    running = 0
    owing, start = log.owing, log.start
    for k, pos in enumerate(ps):
        running += diff[k]
        owing[pos - start] += running


def _exceptions(log: TopicLog, pos: int, plus: frozenset, minus: frozenset, size: int,
                backlog: dict, marks: dict, out: Rebuilt) -> None:
    members = log.members
    i = pos - log.start
    rid = log.route_of[i]
    route = log.routes.get(rid)
    for q in plus:
        m = members.get(q)
        if m is not None and pos >= m.cursor.floor:
            _count(backlog[q], log, i, 1, size)
            if pos <= marks.get(q, 0):
                out.redelivered += 1
    for q in minus:
        m = members.get(q)
        if (m is not None and route is not None and pos >= m.cursor.floor and m.cursor.covers(pos)
                and m.takes(rid, route)):
            _count(backlog[q], log, i, -1, size)
            if pos <= marks.get(q, 0):
                out.redelivered -= 1


def _ranges(log: TopicLog, m: Member, size_at: dict[int, int], acc: list[int], mark: int,
            out: Rebuilt) -> None:
    """Owed positions in the member's settled ranges were counted above: take them out."""
    for lo, hi in m.cursor.ranges:
        for pos in range(max(lo, log.start), min(hi, log.positions.last) + 1):
            i = pos - log.start
            if i < len(log.route_of) and log.route_of[i] and log._owes(m, pos):
                _count(acc, log, i, -1, size_at.get(pos, 0))
                if pos <= mark:
                    out.redelivered -= 1


def _count(acc: list[int], log: TopicLog, i: int, n: int, size: int) -> None:
    acc[0] += n
    acc[1] += n * size
    log.owing[i] += n
