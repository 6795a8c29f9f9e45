"""A seeded nemesis for a cluster whose node a is an HA pair and node b a plain node
(tests/e2e/paired_cluster.py; docs/cluster.md "A node as an HA pair").

`schedule(seed, seconds)` draws the faults (the same seed, the same list); `Nemesis`
carries them out one at a time, each healed before the next:

  kill live      kill -9 of a's live broker, restarted after `duration` (it comes back
                 as the pair's backup)
  kill backup    kill -9 of a's backup, restarted after `duration`
  pause live     SIGSTOP of a's live broker for `duration`, then SIGCONT
  pause-zk       SIGSTOP of ZooKeeper for `duration`, then SIGCONT
  kill b         kill -9 of node b, restarted on its store after `duration`

Pauses are drawn either well under the pair's ZooKeeper session timeout or well over
the cluster's, so that both sides happen (a session that survives; one that expires
and a take-over).  After each fault the nemesis waits, by events and never for a
fixed time, until the cluster is whole again (ZooKeeper answering, one live broker of
the pair and its backup in sync, b live) and every producer had `calm` more messages
Accepted: faults come by count of acknowledged messages, so a slow machine makes a
run longer, not different.

`producer_view_overlaps` is the checker's view of who accepted for node a: each
Accepted seen by a client connected to a broker of the pair is put in that broker's
accept window (tests/faults/checker.py `windows`, from its log) open when the client
saw it; the spans of the client-seen accepts of two windows of different brokers must
not overlap.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tests.faults.checker import Window
from tests.faults.harness import FaultBroker
from tests.faults.nemesis import Nemesis as PairNemesis

KINDS = (("kill", "live", 2.0), ("kill", "backup", 1.0), ("pause", "live", 2.0),
         ("pause-zk", "zookeeper", 1.5), ("kill", "b", 1.5))
STATUS_RE = re.compile(r"in sync with the live broker|replication from .* (ended|failed)|"
                       r"ha: node \S+ is (live|a backup again)|ha: backup:")
HEAL_TIMEOUT = 240.0       # generous: a busy 2-core machine


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str
    duration: float   # seconds the fault lasts (a kill: until the restart)
    calm: int         # messages Accepted by every producer after the heal, before the next fault

    def describe(self) -> str:
        return f"{self.kind} {self.target} for {self.duration:.1f} s, then {self.calm} acks each"


def schedule(seed: int, seconds: float, pair_session: float, cluster_session: float) -> list[Fault]:
    """Faults whose durations (plus a nominal 3 s of healing each) fill `seconds`."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    total = 0.0
    weights = [w for _, _, w in KINDS]
    while total < seconds:
        kind, target, _ = rng.choices(KINDS, weights)[0]
        if kind == "kill":
            duration = rng.uniform(0.2, 1.5 * cluster_session)
        elif rng.random() < 0.5:     # a pause the sessions survive
            duration = rng.uniform(0.2, 0.6 * pair_session)
        else:                        # one that outlasts every session
            duration = rng.uniform(1.3 * cluster_session, 2.5 * cluster_session)
        faults.append(Fault(kind, target, round(duration, 2), rng.randint(20, 80)))
        total += duration + 3.0
    return faults


class Nemesis(PairNemesis):
    """Carries out `faults` on a PairedCluster of FaultBrokers (start, join and the
    notes are the pair's nemesis's); `progress()` is the smallest count of messages
    Accepted by one producer."""

    def __init__(self, cluster, faults: list[Fault], progress: Callable[[], int],
                 describe: Callable[[], str] = lambda: ""):
        self.cluster = cluster
        self.faults = faults
        self.progress = progress
        self.describe = describe     # the clients' state, for a failure's message
        self.done: list[tuple[float, str]] = []
        self.spans: list = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pair-cluster-nemesis", daemon=True)

    def _calm(self, fault) -> None:
        """The pair live with its backup in sync and b live, then `fault.calm` more
        Accepted messages: faults come by count, never by the clock."""
        self.wait_healed()
        self.wait_progress(fault.calm)

    def pair(self) -> list[FaultBroker]:
        return list(self.cluster.pair.values())

    def live(self) -> FaultBroker | None:
        for b in self.pair():
            if b.alive() and not b.paused and b.is_listening():
                return b
        return None

    def _apply(self, fault: Fault) -> None:
        live = self.live() or self.cluster.pair["primary"]
        backup = next(b for b in self.pair() if b is not live)
        if fault.kind == "pause-zk":
            self._note(f"SIGSTOP zookeeper for {fault.duration:.1f} s")
            self._touch("zookeeper")
            self.cluster.zk.pause()
            self.stop.wait(fault.duration)
            self.cluster.zk.resume()
            self._note("SIGCONT zookeeper")
            return
        broker = {"live": live, "backup": backup, "b": self.cluster.b}[fault.target]
        if fault.kind == "kill":
            self._kill_for(broker, fault)
        else:
            self._note(f"SIGSTOP {broker.name} ({fault.target}) for {fault.duration:.1f} s")
            self._touch(broker.name)
            broker.pause()
            self.stop.wait(fault.duration)
            broker.resume()
            self._note(f"SIGCONT {broker.name}")

    # --- healing -----------------------------------------------------------
    def healed(self) -> bool:
        if not self.cluster.zk.ruok():
            return False
        live = self.live()
        if live is None or not self.cluster.b.alive() or not self.cluster.b.is_listening():
            return False
        if not any("cluster: node b is live (" in ln for ln in self.cluster.b.lines):
            return False
        backup = next(b for b in self.pair() if b is not live)
        if not backup.alive() or backup.is_listening():
            return False
        statuses = [m.group(0) for ln in backup.lines if (m := STATUS_RE.search(ln))]
        return bool(statuses) and statuses[-1].startswith("in sync")

    def wait_healed(self) -> None:
        deadline = time.monotonic() + HEAL_TIMEOUT
        while not self.healed():
            if self.stop.is_set():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not whole again {HEAL_TIMEOUT} s after "
                                   f"{self.done[-1][1] if self.done else 'the start'}: {self.describe()}\n"
                                   + self.tails())
            time.sleep(0.2)

    def wait_progress(self, more: int) -> None:
        target = self.progress() + more
        deadline = time.monotonic() + HEAL_TIMEOUT
        while self.progress() < target and not self.stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no producer progress ({self.progress()} of {target}) {HEAL_TIMEOUT} s after "
                                   f"{self.done[-1][1] if self.done else 'the start'}: {self.describe()}\n"
                                   + self.tails())
            time.sleep(0.1)

    def settle(self) -> None:
        """Everything resumed and running again (after a failure of the schedule too)."""
        self.cluster.zk.resume()
        for b in self.cluster.brokers():
            b.resume()
            if not b.alive():
                b.start(wait=False)
        self._note("settle: resumed, restarted")

    def tails(self, n: int = 30) -> str:
        return "\n".join(f"--- {b.name} (alive: {b.alive()}, listening: {b.is_listening()})\n"
                         + "".join(b.all_lines()[-n:]) for b in self.cluster.brokers())


def producer_view_overlaps(accepts: list[tuple[str, float]], log_windows: list[Window]) -> tuple[list[str], dict]:
    """`accepts`: (broker name, time.time() the client saw Accepted) from clients of
    the pair's brokers.  Returns the violations and, per broker, the client-seen spans."""
    found: list[str] = []
    spans: dict[tuple[str, float], list[float]] = {}
    by_broker: dict[str, list[Window]] = {}
    for w in log_windows:
        by_broker.setdefault(w.broker, []).append(w)
    for broker, seen in sorted(accepts, key=lambda a: a[1]):
        opened = [w for w in by_broker.get(broker, []) if w.start <= seen]
        if not opened:
            found.append(f"{broker} answered Accepted at {seen:.3f} with no accept window open before")
            continue
        w = max(opened, key=lambda x: x.start)
        span = spans.setdefault((broker, w.start), [seen, seen])
        span[0], span[1] = min(span[0], seen), max(span[1], seen)
    items = sorted(spans.items(), key=lambda kv: kv[1][0])
    for i, ((b1, _), (s1, e1)) in enumerate(items):
        for (b2, _), (s2, e2) in items[i + 1:]:
            if b1 != b2 and s1 < e2 and s2 < e1:
                found.append(f"clients saw {b1} accept over [{s1:.3f}, {e1:.3f}] and {b2} over [{s2:.3f}, {e2:.3f}]")
    per_broker: dict[str, list[tuple[float, float]]] = {}
    for (b, _), (s, e) in items:
        per_broker.setdefault(b, []).append((round(s, 3), round(e, 3)))
    return found, per_broker
