"""An HA pair whose every link a fault test controls (docs/ha.md, "Fault cases").

ZooKeeper (the Debian package, tests/e2e/ha_harness.py) and two broker processes;
each broker reaches ZooKeeper through a relay of its own, and each advertises its
replication listener through a relay, so a test can cut and heal the replication
link and either broker's ZooKeeper link (tests/faults/relay.py), besides kill -9,
restart and SIGSTOP / SIGCONT of any process.  Every log line of every broker
incarnation is kept (`history`): the checker reads the accept windows from it.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from pathlib import Path

from tests.e2e.ha_harness import SECRET, HaBroker, ZooKeeper, free_port
from tests.faults.relay import Relay

REPLICATION_RE = re.compile(r"ha: replication listening on ([\d.]+):(\d+)")


class FaultBroker(HaBroker):
    """A pair's broker whose log lines survive its restarts, with its two relays."""

    def __init__(self, name: str, data_dir: Path, config: str, amqp_port: int, zk_relay: Relay,
                 replication_relay: Relay):
        super().__init__(name, data_dir, config, amqp_port)
        self.zk_relay = zk_relay
        self.replication_relay = replication_relay
        self.history: list[str] = []      # lines of earlier incarnations
        self.events: list[tuple[float, str]] = []   # (time.time(), "killed" | "started" | ...)
        self.paused = False
        self.exits: list[int] = []       # exit statuses of incarnations that ended on their own
        self.exit_tails: list[str] = []  # and their last log lines
        self._killed = False

    def start(self, wait: bool = True) -> "FaultBroker":
        if self.proc is not None and self.proc.poll() is not None and not self._killed:
            self.exits.append(self.proc.returncode)
            self.exit_tails.append("".join(self.lines[-40:]))
        self._killed = False
        self.history.extend(self.lines)
        self.events.append((time.time(), "started"))
        super().start(wait)
        return self

    def all_lines(self) -> list[str]:
        with self._cond:
            return self.history + self.lines

    def replication_target(self) -> tuple[str, int] | None:
        with self._cond:
            for line in reversed(self.lines):
                m = REPLICATION_RE.search(line)
                if m:
                    return m.group(1), int(m.group(2))
        return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.proc.send_signal(signal.SIGCONT)
                self.paused = False
            self.proc.kill()
            self.proc.wait()
            self._killed = True
            self.events.append((time.time(), "killed"))

    def pause(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True
            self.events.append((time.time(), "paused"))

    def resume(self) -> None:
        if self.paused and self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.paused = False
            self.events.append((time.time(), "resumed"))

    def unexpected_exits(self) -> list[int]:
        """Exit statuses of incarnations that ended without a kill (including the current one)."""
        out = list(self.exits)
        if self.proc is not None and self.proc.poll() is not None and not self._killed:
            out.append(self.proc.returncode)
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def mark(self) -> int:
        """A position in the current incarnation's log, for wait_for_log(after=...)."""
        with self._cond:
            return len(self.lines)

    def management_url(self) -> str | None:
        port = self.ports.get("management")
        return f"http://127.0.0.1:{port}" if port else None


def fault_config(zk_address: str, cluster: str, role: str, amqp_port: int, replication_address: str,
                 session_timeout: float, backup_timeout: float, extra: dict | None = None) -> str:
    lines = [f"port = {amqp_port}", "[ha]", f'role = "{role}"', f'zookeeper = "{zk_address}"',
             f"zookeeper_session_timeout = {session_timeout}", f'cluster = "{cluster}"',
             "replication_port = 0", f'advertised_replication = "{replication_address}"',
             f'secret = "{SECRET}"', f"backup_timeout = {backup_timeout}"]
    for key, value in (extra or {}).items():
        lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {str(value).lower()}")
    return "\n".join(lines) + "\n"


class FaultPair:
    """Brokers "a" (primary) and "b" (backup) behind relays, on one ZooKeeper."""

    def __init__(self, zk: ZooKeeper, root: Path, session_timeout: float = 2.0, backup_timeout: float = 2.0,
                 extra: dict | None = None):
        self.zk = zk
        self.cluster = uuid.uuid4().hex[:8]
        self.brokers: dict[str, FaultBroker] = {}
        self.relays: list[Relay] = []
        for name, role in (("a", "primary"), ("b", "backup")):
            zk_relay = Relay(lambda: ("127.0.0.1", zk.port), f"zk-{name}").start()
            holder: dict[str, FaultBroker] = {}
            repl_relay = Relay(lambda h=holder: h["b"].replication_target(), f"repl-{name}").start()
            self.relays += [zk_relay, repl_relay]
            port = free_port()
            config = fault_config(zk_relay.address, self.cluster, role, port, repl_relay.address,
                                  session_timeout, backup_timeout, extra)
            broker = FaultBroker(name, root / name, config, port, zk_relay, repl_relay)
            holder["b"] = broker
            self.brokers[name] = broker

    @property
    def a(self) -> FaultBroker:
        return self.brokers["a"]

    @property
    def b(self) -> FaultBroker:
        return self.brokers["b"]

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.brokers.values()]

    def start(self, sync_timeout: float = 60.0) -> "FaultPair":
        self.a.start().wait_live(30)
        self.b.start().wait_for_log("in sync with the live broker", sync_timeout)
        return self

    def other(self, broker: FaultBroker) -> FaultBroker:
        return self.b if broker is self.a else self.a

    def live(self) -> FaultBroker | None:
        """The broker whose AMQP listener accepts connections now (None: neither)."""
        for b in self.brokers.values():
            if b.alive() and not b.paused and b.is_listening():
                return b
        return None

    def wait_any_live(self, timeout: float) -> FaultBroker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.live()
            if live is not None:
                return live
            time.sleep(0.1)
        raise TimeoutError(f"no broker of the pair became live in {timeout} s:\n"
                           + "\n".join(f"--- {b.name}\n" + "".join(b.all_lines()[-40:]) for b in self.brokers.values()))

    def tails(self, n: int = 40) -> str:
        return "\n".join(f"--- {b.name} (alive: {b.alive()}, listening: {b.is_listening()})\n"
                         + "".join(ln for ln in b.all_lines()[-n:]) for b in self.brokers.values())

    def close(self) -> None:
        for b in self.brokers.values():
            b.kill()
        for r in self.relays:
            r.stop()
