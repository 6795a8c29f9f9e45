"""A Jepsen-style nemesis for the HA pair (docs/ha.md, "Fault cases").

`schedule(seed, seconds)` draws a list of faults from a seeded generator: what is
done, to which role, for how long, and how long the calm after it lasts — the same
seed, the same list.  `Nemesis` carries a list out on a FaultPair (the roles are
resolved when a fault starts: "live" is the broker whose listener answers then),
one fault at a time, each healed before the next:

  kill        kill -9 of the live broker or the backup, restarted when the fault ends
  pause       SIGSTOP of the live broker or the backup, SIGCONT when it ends
  pause-zk    SIGSTOP of ZooKeeper
  cut-repl    the replication link cut through its relays (a partition: bytes held,
              or a reset: connections refused), healed when it ends
  cut-zk      one broker's ZooKeeper link cut the same way

Durations are drawn around the session timeout, so that both sides of it happen:
a pause the session survives (the live broker re-validates and goes on) and one it
does not (the backup takes over).  Timing noise of a busy machine changes the
interleavings, never the list; the checker (tests/faults/checker.py) must hold for
any interleaving.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from tests.faults.checker import FaultSpan
from tests.faults.harness import FaultBroker, FaultPair
from tests.faults.relay import PARTITION, RESET

KINDS = (  # (kind, target, weight)
    ("kill", "live", 2.0), ("kill", "backup", 1.0),
    ("pause", "live", 2.0), ("pause", "backup", 1.0),
    ("pause-zk", "zookeeper", 1.0),
    ("cut-repl", "link", 1.5),
    ("cut-zk", "live", 1.5), ("cut-zk", "backup", 1.0),
)


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str
    how: str          # cuts: "partition" | "reset"
    duration: float   # seconds the fault lasts (a kill: until the restart)
    calm: float       # seconds after it is healed, before the next one

    def describe(self) -> str:
        how = f" ({self.how})" if self.how else ""
        return f"{self.kind} {self.target}{how} for {self.duration:.1f} s, calm {self.calm:.1f} s"


def schedule(seed: int, seconds: float, session_timeout: float) -> list[Fault]:
    """Faults filling `seconds` (durations and calms included; the last one shortened to fit)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    total = 0.0
    weights = [w for _, _, w in KINDS]
    while True:
        kind, target, _ = rng.choices(KINDS, weights)[0]
        how = rng.choice((PARTITION, RESET)) if kind.startswith("cut") else ""
        longest = {"kill": 2.0, "pause": 3.0, "pause-zk": 2.5, "cut-repl": 3.0, "cut-zk": 3.0}[kind]
        duration = round(rng.uniform(0.3, longest * session_timeout), 2)
        calm = round(rng.uniform(1.0, 4.0), 2)
        left = seconds - total
        if left < 1.5:
            return faults
        if duration + calm > left:
            calm = 1.0
            duration = round(left - calm, 2)
        faults.append(Fault(kind, target, how, duration, calm))
        total += duration + calm


class Nemesis:
    def __init__(self, pair: FaultPair, faults: list[Fault]):
        self.pair = pair
        self.faults = faults
        self.done: list[tuple[float, str]] = []    # (time.time(), what was done to whom)
        self.spans: list[FaultSpan] = []            # each fault: when, and whom it touched
        self._touched: set[str] = set()             # whom the fault being carried out touches
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "Nemesis":
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("the nemesis did not finish its schedule")
        if self.error is not None:
            raise self.error

    def _note(self, what: str) -> None:
        self.done.append((time.time(), what))

    def _touch(self, name: str) -> None:
        """The fault being carried out acts on `name` (a broker, "zookeeper", "replication")."""
        self._touched.add(name)

    def _roles(self) -> tuple[FaultBroker, FaultBroker]:
        live = self.pair.live() or self.pair.a
        return live, self.pair.other(live)

    def _run(self) -> None:
        try:
            for fault in self.faults:
                if self.stop.is_set():
                    return
                self._touched = set()
                start = time.time()
                self._apply(fault)
                self.spans.append(FaultSpan(start, time.time(), frozenset(self._touched)))
                self._calm(fault)
        except BaseException as exc:   # reported by join()
            self.error = exc

    def _calm(self, fault: Fault) -> None:
        """Between a healed fault and the next."""
        self.stop.wait(fault.calm)

    def _kill_for(self, broker: FaultBroker, fault: Fault) -> None:
        """kill -9, and the broker started again on its store `fault.duration` later."""
        self._note(f"kill -9 {broker.name} ({fault.target})")
        self._touch(broker.name)
        broker.kill()
        self.stop.wait(fault.duration)
        broker.start(wait=False)
        self._note(f"restart {broker.name} after {fault.duration:.1f} s")

    def _apply(self, fault: Fault) -> None:
        live, backup = self._roles()
        broker = live if fault.target == "live" else backup
        if fault.kind == "kill":
            self._kill_for(broker, fault)
        elif fault.kind == "pause":
            self._note(f"SIGSTOP {broker.name} ({fault.target})")
            self._touch(broker.name)
            broker.pause()
            self.stop.wait(fault.duration)
            broker.resume()
            self._note(f"SIGCONT {broker.name}")
        elif fault.kind == "pause-zk":
            self._note("SIGSTOP zookeeper")
            self._touch("zookeeper")
            self.pair.zk.pause()
            self.stop.wait(fault.duration)
            self.pair.zk.resume()
            self._note("SIGCONT zookeeper")
        elif fault.kind == "cut-repl":
            relays = [b.replication_relay for b in self.pair.brokers.values()]
            self._note(f"cut the replication link ({fault.how})")
            self._touch("replication")
            for r in relays:
                r.cut(fault.how)
            self.stop.wait(fault.duration)
            for r in relays:
                r.heal()
            self._note("heal the replication link")
        elif fault.kind == "cut-zk":
            self._note(f"cut {broker.name}'s ZooKeeper link ({fault.target}, {fault.how})")
            self._touch(broker.name)
            broker.zk_relay.cut(fault.how)
            self.stop.wait(fault.duration)
            broker.zk_relay.heal()
            self._note(f"heal {broker.name}'s ZooKeeper link")
        else:
            raise ValueError(fault.kind)

    def settle(self) -> None:
        """Everything healed, resumed and running again."""
        self.pair.zk.resume()
        for b in self.pair.brokers.values():
            b.zk_relay.heal()
            b.replication_relay.heal()
            b.resume()
            if not b.alive():
                b.start(wait=False)
        self._note("settle: healed, resumed, restarted")
