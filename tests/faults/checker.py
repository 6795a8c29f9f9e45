"""The checker of the fault suite: what clients were told against what happened.

* Lost: every durable message a producer was told Accepted must have reached its
  consumer at least once once the dust settled (the queue's consumer, or the
  shared durable subscription's for the topic).  Non-durable messages live in the
  live broker's memory only (docs/ha.md): their figures are reported, not held
  to that.
* Duplicates: copies beyond the first, counted and reported (at-least-once).
* Accept windows: every broker logs when it starts and stops accepting, with the
  activation it serves ("ha: accept window open/closed: node=.. activation=..
  at=<time.time()>"); a window that a kill -9 ended closes at the kill.  No two
  windows of different brokers may overlap in time, and no activation number may
  be served by two brokers.
* Exits: no broker process may end on its own (only the nemesis kills).
* Step-downs: a live broker whose accept window closed because the lock was no
  longer its own ("invalid") while no fault touched it or ZooKeeper stepped down
  because of something another broker did: a bug (a demoted broker deleted the
  new live broker's lock: the pair had no live broker until one contended again).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tests.faults.clients import Ledger
from tests.faults.harness import FaultBroker

WINDOW_RE = re.compile(r"ha: accept window (open|closed): node=(\S+) activation=(\d+) at=([\d.]+)(?: \(([^)]*)\))?")
INVALID = "invalid"      # the live broker's lock is another's, or the activation moved (core/ha.py)


@dataclass
class Window:
    broker: str
    node: str
    activation: int
    start: float
    end: float = float("inf")
    ended_by: str = "still open"
    why: str = ""           # the reason the broker logged when it closed the window


@dataclass(frozen=True)
class FaultSpan:
    """One fault of a nemesis: when it started and was healed, and whom it touched
    (broker names, "zookeeper", "replication")."""
    start: float
    end: float
    touched: frozenset[str]


def windows(broker: FaultBroker) -> list[Window]:
    """The accept windows in a broker's log, across its incarnations."""
    out: list[Window] = []
    events = sorted(t for t, what in broker.events if what == "killed")
    current: Window | None = None
    for line in broker.all_lines():
        m = WINDOW_RE.search(line)
        if not m:
            continue
        kind, node, activation, at, why = m.group(1), m.group(2), int(m.group(3)), float(m.group(4)), m.group(5)
        if current is not None and kind == "open":   # the last one never closed: the process was killed
            kill = next((t for t in events if t >= current.start), float("inf"))
            current.end, current.ended_by = kill, "kill -9"
            out.append(current)
            current = None
        if kind == "open":
            current = Window(broker.name, node, activation, at)
        elif current is not None:
            current.end, current.ended_by, current.why = at, "closed", why or ""
            out.append(current)
            current = None
    if current is not None:
        kill = next((t for t in events if t >= current.start), float("inf"))
        current.end, current.ended_by = kill, "kill -9" if kill != float("inf") else "still open"
        out.append(current)
    return out


def overlaps(all_windows: list[Window]) -> list[str]:
    found = []
    for i, w in enumerate(all_windows):
        for v in all_windows[i + 1:]:
            if w.broker == v.broker:
                continue
            if w.start < v.end and v.start < w.end:
                found.append(f"{w.broker} activation {w.activation} [{w.start:.3f}, {w.end:.3f}] ({w.ended_by}) and "
                             f"{v.broker} activation {v.activation} [{v.start:.3f}, {v.end:.3f}] ({v.ended_by})")
    by_activation: dict[int, set[str]] = {}
    for w in all_windows:
        by_activation.setdefault(w.activation, set()).add(w.node)
    found += [f"activation {a} served by {sorted(nodes)}" for a, nodes in by_activation.items() if len(nodes) > 1]
    return found


def unprovoked_stepdowns(all_windows: list[Window], spans: list[FaultSpan], slack: float) -> list[str]:
    """Windows closed "invalid" with no fault on their broker or on ZooKeeper from
    `slack` seconds before the window opened to its close (a fault's effects, such as
    a session that expires, may come a while after it)."""
    found = []
    for w in all_windows:
        if w.ended_by != "closed" or w.why != INVALID:
            continue
        near = [s for s in spans if s.touched & {w.broker, "zookeeper"} and s.start <= w.end
                and s.end >= w.start - slack]
        if not near:
            found.append(f"{w.broker} activation {w.activation} stepped down at {w.end:.3f} (lock not its own) "
                         f"with no fault on it or on ZooKeeper since {w.start - slack:.3f}")
    return found


@dataclass
class Verdict:
    accepted_durable: int = 0
    accepted_non_durable: int = 0
    lost: list[str] = field(default_factory=list)
    non_durable_missing: int = 0
    duplicates: int = 0
    windows: list[Window] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    stepdowns: list[str] = field(default_factory=list)
    exits: dict[str, list[int]] = field(default_factory=dict)
    details: str = ""       # log tails, for a failure's message

    @property
    def ok(self) -> bool:
        return not self.lost and not self.overlaps and not self.stepdowns and not any(self.exits.values())

    def summary(self) -> str:
        return (f"{self.accepted_durable} durable + {self.accepted_non_durable} non-durable Accepted; "
                f"lost {len(self.lost)}; duplicates {self.duplicates}; non-durable not delivered "
                f"{self.non_durable_missing}; accept windows {len(self.windows)}, overlapping "
                f"{len(self.overlaps)}; unprovoked step-downs {len(self.stepdowns)}; unexpected exits {self.exits}")


def check(ledger: Ledger, streams: dict[str, str], brokers: list[FaultBroker],
          extra_received: dict[str, set[str]] | None = None, spans: list[FaultSpan] | None = None,
          slack: float = 0.0) -> Verdict:
    """`streams`: producer name prefix -> the consumer stream that must receive it;
    `spans`: the nemesis's faults (given: step-downs are checked, `slack` seconds back)."""
    v = Verdict()
    extra_received = extra_received or {}
    with ledger.lock:
        accepted = dict(ledger.accepted)
        sent = dict(ledger.sent)
        received = {name: dict(got) for name, got in ledger.received.items()}
    for mid in accepted:
        producer = mid.rsplit("-", 1)[0]
        stream = streams[producer]
        got = mid in received.get(stream, {}) or mid in extra_received.get(stream, set())
        if sent[mid]:
            v.accepted_durable += 1
            if not got:
                v.lost.append(mid)
        else:
            v.accepted_non_durable += 1
            v.non_durable_missing += not got
    v.duplicates = sum(n - 1 for got in received.values() for n in got.values() if n > 1)
    v.duplicates += sum(1 for s, ids in extra_received.items() for mid in ids if mid in received.get(s, {}))
    for b in brokers:
        v.windows += windows(b)
        v.exits[b.name] = b.unexpected_exits()
    v.windows.sort(key=lambda w: w.start)
    v.overlaps = overlaps(v.windows)
    if spans is not None:
        v.stepdowns = unprovoked_stepdowns(v.windows, spans, slack)
    v.lost.sort()
    return v
