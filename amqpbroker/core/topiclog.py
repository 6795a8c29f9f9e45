"""The topic log's index: which durable subscription owes which stored message
(pure state, no I/O; docs/architecture.md "Durable subscriptions").

A message stored for durable subscriptions is one log record at a *position*
(store/topiclog.py writes it); every subscription queue of the log (a *member*)
has a `Cursor` (core/cursors.py) and, while its subscription binding has no
filter, a *rule*: the binding (exchange, key) and the positions it covers (from
the one it joined at).  A record names its *route* (exchange, routing key) and
only the exceptions to the rules: `plus`, the members that got it without a rule
taking it (a selector or no-local accepted it, a direct send, a move, a dead
letter), and `minus`, the members whose rule takes it but that did not get it.
So a message to N unfiltered subscriptions is recorded in O(1), whatever N.

In memory, per position from the oldest record still owed (`start`) to the newest:
its route id (0: no record) and how many members still owe it (`owing`): at zero
the record and its body may go.  Positions are broker-wide (`Positions`), and they
are the members' sequence numbers.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Iterator

from .cursors import Cursor
from .exchanges import ExchangeType, binding_matches

Route = tuple  # ("exchange", name, routing key) | ("direct",) | ("every",)
DIRECT: Route = ("direct",)     # reaches members through `plus` only
EVERY: Route = ("every",)       # every member whose rule covers the position (the store upgrade's)
TRIM_RUN = 1024                 # free positions at the head of the index before it is cut
RULE_SETS = 64                  # routes whose rule members are kept (core of a fan-out's classification)


class Positions:
    """The broker-wide counter of log positions: `next()` allocates one (a member
    queue's `_seq` is this object, so its sequence numbers are positions)."""

    __slots__ = ("last",)

    def __init__(self, last: int = 0):
        self.last = last

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        self.last += 1
        return self.last


class Member:
    """A durable subscription queue of the log: its cursor and its rule (the
    subscription binding; `exchange` None: no rule, every record names it)."""

    __slots__ = ("queue_id", "cursor", "exchange", "kind", "binding_key", "_takes", "next_owed")

    def __init__(self, queue_id: int, cursor: Cursor, exchange: str | None = None,
                 kind: ExchangeType | None = None, binding_key: str | None = None):
        self.queue_id = queue_id
        self.cursor = cursor
        self.exchange = exchange
        self.kind = kind
        self.binding_key = binding_key
        self._takes: dict[int, bool] = {}
        self.next_owed: Callable[[int], int] | None = None   # TopicLog.next_owed(member), made once

    def takes(self, rid: int, route: Route) -> bool:
        """Whether the member's rule takes records of this route (at covered positions)."""
        hit = self._takes.get(rid)
        if hit is None:
            if route is EVERY or route == EVERY:
                hit = True
            elif route[0] != "exchange" or self.exchange is None:
                hit = False
            else:
                hit = route[1] == self.exchange and binding_matches(self.kind, self.binding_key, route[2])
            if len(self._takes) >= 256:
                self._takes.clear()   # per-message routing keys: a bounded memo
            self._takes[rid] = hit
        return hit


class TopicLog:
    def __init__(self, last_position: int = 0):
        self.positions = Positions(last_position)
        self.start = last_position + 1        # the position of index slot 0
        self.route_of = array("I")           # route id per position (0: no record)
        self.owing = array("I")              # members still owing the position
        self.exceptions: dict[int, tuple[frozenset, frozenset]] = {}   # position -> (plus, minus)
        self.routes: dict[int, Route] = {}
        self.route_ids: dict[Route, int] = {}
        self.route_refs: dict[int, int] = {}  # route id -> records naming it
        self.next_route = 1
        self.members: dict[int, Member] = {}
        self._rule_sets: dict[int, frozenset] = {}   # route id -> members (still bound) whose rule takes it
        self.records = 0
        self.freed_routes: list[int] = []     # routes no record names any more (the store deletes them)
        self._free_head = 0                   # index slots at the head known to be free

    # ------------------------------------------------------------------ routes and records

    def route(self, route: Route) -> tuple[int, bool]:
        """The id of a route, and whether it is new (the store writes it)."""
        rid = self.route_ids.get(route)
        if rid is not None:
            return rid, False
        rid = self.next_route
        self.next_route += 1
        self.routes[rid] = route
        self.route_ids[route] = rid
        self.route_refs[rid] = 0
        return rid, True

    def add_route(self, rid: int, route: Route) -> None:
        """A route read back from the store."""
        self.routes[rid] = route
        self.route_ids[route] = rid
        self.route_refs.setdefault(rid, 0)
        self.next_route = max(self.next_route, rid + 1)

    def append(self, pos: int, rid: int, routed: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A record at `pos` (just allocated) with route `rid` reached the members
        `routed` (queue ids): its exceptions to the rules, (plus, minus)."""
        takers = self._rule_set(rid)
        plus = [q for q in routed if q not in takers]
        minus: tuple[int, ...] = ()
        if len(takers) > len(routed) - len(plus):   # a rule took what the exchange did not route
            minus = tuple(takers.difference(routed))
        self.put(pos, rid, len(routed), frozenset(plus), frozenset(minus))
        return tuple(plus), minus

    def _rule_set(self, rid: int) -> frozenset:
        """The members still bound whose rule takes route `rid` (they cover every new
        position): kept for the last RULE_SETS routes, dropped when members change."""
        hit = self._rule_sets.get(rid)
        if hit is None:
            route = self.routes[rid]
            hit = frozenset(q for q, m in self.members.items() if m.cursor.left is None and m.takes(rid, route))
            if len(self._rule_sets) >= RULE_SETS:
                self._rule_sets.pop(next(iter(self._rule_sets)))
            self._rule_sets[rid] = hit
        return hit

    def put(self, pos: int, rid: int, owing: int, plus: frozenset = frozenset(),
            minus: frozenset = frozenset()) -> None:
        """Index a record (`owing` members owe it)."""
        i = pos - self.start
        if i < 0:
            raise ValueError(f"log position {pos} is below the index start {self.start}")
        n = len(self.route_of)
        if i >= n:
            zeros = array("I", bytes(4 * (i + 1 - n)))
            self.route_of.extend(zeros)
            self.owing.extend(zeros)
        self.route_of[i] = rid
        self.owing[i] = owing
        if plus or minus:
            self.exceptions[pos] = (plus, minus)
        self.route_refs[rid] = self.route_refs.get(rid, 0) + 1
        self.records += 1
        if pos > self.positions.last:
            self.positions.last = pos

    def route_at(self, pos: int) -> int:
        i = pos - self.start
        return self.route_of[i] if 0 <= i < len(self.route_of) else 0

    def owing_at(self, pos: int) -> int:
        i = pos - self.start
        return self.owing[i] if 0 <= i < len(self.owing) else 0

    # ------------------------------------------------------------------ who owes what

    def owes(self, qid: int, pos: int) -> bool:
        m = self.members.get(qid)
        return m is not None and self._owes(m, pos)

    def _owes(self, m: Member, pos: int) -> bool:
        i = pos - self.start
        if i < 0 or i >= len(self.route_of):
            return False
        rid = self.route_of[i]
        if not rid:
            return False
        ex = self.exceptions.get(pos)
        if ex is not None:
            if m.queue_id in ex[0]:
                return True
            if m.queue_id in ex[1]:
                return False
        return m.cursor.covers(pos) and m.takes(rid, self.routes[rid])

    def next_owed(self, m: Member) -> Callable[[int], int]:
        """next_owed(x): the smallest position above x that `m` owes (settled or not),
        or the first one not allocated yet (core/cursors.py)."""
        def nxt(x: int) -> int:
            p = max(x + 1, self.start)
            end = self.start + len(self.route_of)
            route_of, start = self.route_of, self.start
            while p < end:
                if route_of[p - start] and self._owes(m, p):
                    return p
                p += 1
            return max(p, self.positions.last + 1)
        return nxt

    def owed_after(self, qid: int, after: int, limit: int, below: int | None = None) -> list[int]:
        """Up to `limit` positions above `after` (and below `below`) that member `qid`
        owes and has not settled, in order."""
        m = self.members.get(qid)
        if m is None:
            return []
        c = m.cursor
        p = max(after + 1, c.floor, self.start)
        end = self.start + len(self.route_of)
        if below is not None:
            end = min(end, below)
        out: list[int] = []
        route_of, start = self.route_of, self.start
        while p < end and len(out) < limit:
            q = c.skip(p)
            if q != p:
                p = q
                continue
            if route_of[p - start] and self._owes(m, p):
                out.append(p)
            p += 1
        return out

    # ------------------------------------------------------------------ settling

    def settle(self, qid: int, pos: int) -> bool:
        """Member `qid` settled owed position `pos`; True when no member owes the
        record any more (the store deletes it and its reference to the body)."""
        m = self.members.get(qid)
        if m is None or not self._owes(m, pos):
            return False
        nxt = m.next_owed
        if nxt is None:
            nxt = m.next_owed = self.next_owed(m)
        if not m.cursor.settle(pos, nxt):
            return False
        return self._release(pos)

    def _release(self, pos: int) -> bool:
        i = pos - self.start
        if i < 0 or i >= len(self.owing) or not self.owing[i]:
            return False
        self.owing[i] -= 1
        if self.owing[i]:
            return False
        self._forget(i, pos)
        return True

    def _forget(self, i: int, pos: int) -> None:
        rid = self.route_of[i]
        self.route_of[i] = 0
        self.owing[i] = 0
        self.exceptions.pop(pos, None)
        if rid:
            self.records -= 1
            left = self.route_refs.get(rid, 1) - 1
            self.route_refs[rid] = left
            if not left and rid in self.routes:
                self._drop_route(rid)
        if i == self._free_head:
            self._trim()

    def _drop_route(self, rid: int) -> None:
        route = self.routes.pop(rid)
        self.route_ids.pop(route, None)
        self.route_refs.pop(rid, None)
        self._rule_sets.pop(rid, None)
        self.freed_routes.append(rid)

    def _trim(self) -> None:
        """Cut the free positions at the head of the index (in runs, not one by one)."""
        route_of = self.route_of
        n = len(route_of)
        k = self._free_head
        while k < n and not route_of[k]:
            k += 1
        self._free_head = k
        if k >= TRIM_RUN or k == n:
            del route_of[:k]
            del self.owing[:k]
            self.start += k
            self._free_head = 0

    def lost(self, pos: int) -> None:
        """The record at `pos` did not reach the disk (a failed batch): nobody owes it."""
        i = pos - self.start
        if 0 <= i < len(self.route_of) and self.route_of[i]:
            self._forget(i, pos)

    # ------------------------------------------------------------------ members

    def join(self, member: Member) -> None:
        self.members[member.queue_id] = member
        self._rule_sets.clear()

    def unbind(self, qid: int) -> None:
        """The member's subscription binding is gone: its rule covers no later position."""
        m = self.members.get(qid)
        if m is not None and m.cursor.left is None:
            m.cursor.left = self.positions.last + 1
            self._rule_sets.clear()

    def leave(self, qid: int) -> list[int]:
        """The member is deleted: every position it still owes is released; returns
        the positions no member owes any more."""
        m = self.members.get(qid)
        if m is None:
            return []
        freed = []
        for pos in self.owed_after(qid, 0, 1 << 62):
            if self._release(pos):
                freed.append(pos)
        del self.members[qid]
        self._rule_sets.clear()
        return freed

    def rule_count(self, rid: int) -> int:
        """Members still bound whose rule takes route `rid`."""
        return len(self._rule_set(rid))

    def member_positions(self, qid: int) -> Iterator[int]:
        """Every position member `qid` owes and has not settled (recovery, deletion)."""
        m = self.members.get(qid)
        if m is None:
            return iter(())
        return iter(self.owed_after(qid, 0, 1 << 62))

    def describe(self) -> dict[str, Any]:
        """Figures for logs and metrics."""
        return {"records": self.records, "members": len(self.members), "routes": len(self.routes),
                "index_positions": len(self.route_of), "start": self.start,
                "last_position": self.positions.last}
