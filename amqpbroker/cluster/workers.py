"""`amqpbroker serve --workers N`: N broker nodes on one machine, one per core.

The supervisor (this process) does no broker work.  It reserves the AMQP port, writes
what the workers share (node names, slot weights, inter-node socket names, a fresh
secret) to `<data-dir>/workers.json` (mode 0600), and starts N node processes
(`serve … --worker K`), each with its own store in `<data-dir>/node-K`.  Every
worker listens on the same port with SO_REUSEPORT, so the kernel spreads incoming
connections over them; the slot map is static (`core/placement.static_map`), and
the nodes reach each other over abstract Unix sockets.  A worker that dies is
started again on its own data dir (its slots are unavailable meanwhile); SIGTERM or
SIGINT stops them all.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Settings
from ..core.numbers import ascii_int
from ..core.placement import DEFAULT_SLOTS
from ..store.layout import single_store, worker_stores
from .gate import StartGate
from .node import EXIT_DRAINED, EXIT_REFUSED, WorkerSpec

log = logging.getLogger("amqpbroker.cluster")

RESTART_DELAY = 0.5   # seconds before a dead worker is started again (doubling, up to 10 s)
MAX_RESTART_DELAY = 10.0
WAITING_NOTE = 10.0   # seconds between the supervisor's lines naming the workers the gate waits for
# A worker that exits "cannot start" (its configuration, its store, a file it needs)
# this many times without ever serving stops the whole start, as one broker would
# exit: started again for ever it would serve nothing and never exit.  Fewer are
# tried again (a worker killed or failing once during the start is waited for), and
# one that has served is started again for as long as it takes (the others serve).
EXIT_CANNOT_START = 2
START_REFUSALS = 3


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_count(value: str) -> int:
    """`--workers N` or `auto` (the machine's cores).  At most one worker per slot of
    the map: a worker beyond them would own nothing."""
    if value == "auto":
        return usable_cores()
    n = ascii_int(value)
    if n is None:
        raise ValueError(f"--workers needs a number of workers or auto, not {value!r}")
    if n < 1:
        raise ValueError("--workers must be at least 1")
    if n > DEFAULT_SLOTS:
        raise ValueError(f"--workers {n}: at most {DEFAULT_SLOTS}, the slots of the map (docs/cluster.md)")
    return n


def crowding(count: int, cores: int) -> str | None:
    """The warning for more workers than cores (None: not more).  Allowed (a machine
    may be shared on purpose), but every worker past the cores only takes turns on one
    with another and adds inter-node hops: rarely what was meant."""
    if count <= cores:
        return None
    return (f"--workers {count} on {cores} usable cores: workers beyond the cores share them and add "
            f"forwarding between workers; --workers auto starts one per core")


def parse_weights(text: str | None, nodes: list[str]) -> dict[str, int]:
    """`--worker-weights 0,1,1`: slots in proportion (0: a node that owns nothing and
    only forwards)."""
    if not text:
        return {n: 1 for n in nodes}
    example = ",".join(["0"] + ["1"] * (len(nodes) - 1))
    wanted = (f"--worker-weights needs {len(nodes)} non-negative whole numbers, not all 0 (e.g. {example}), "
              f"not {text!r}")
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(wanted) from None
    if len(parts) != len(nodes) or any(p < 0 for p in parts) or not any(parts):
        raise ValueError(wanted)
    return dict(zip(nodes, parts))


def check_options(settings: Settings, count: int, weights: str | None) -> None:
    """ValueError for what would make every worker refuse to start (each would exit and
    be started again for ever): weights that cannot be read, a partitioned destination
    with more members than the workers that own slots (cluster/options.py)."""
    from ..core.placement import static_map
    from .options import check_partitioned, cluster_options
    nodes = [f"n{i}" for i in range(count)]
    pinned, partitioned = cluster_options(settings)
    check_partitioned(static_map(nodes, parse_weights(weights, nodes), WorkerSpec.slots,
                                 pinned=pinned, partitioned=partitioned))


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold the shared port (bound with SO_REUSEPORT, never listening, so the kernel
    gives it no connection) so that port 0 means one free port for every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(self, settings: Settings, count: int, weights: str | None, argv: list[str]):
        self.settings = settings
        self.nodes = [f"n{i}" for i in range(count)]
        self.serving = count              # the nodes that serve clients: n0 … n{count-1}
        self.weights = parse_weights(weights, self.nodes)
        self.draining: set[int] = set()   # node-K stores beyond N: emptied, then set aside
        self.argv = argv            # the serve command line, minus --workers
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, float] = {}
        self.refusals: dict[int, int] = {}   # "cannot start" exits of each worker that has never served
        self.stopping = False
        self.exit_code = 0
        self.node_ports: dict[str, int] = {}

    def spec(self, port: int, node_ports: dict[str, int]) -> WorkerSpec:
        token = secrets.token_hex(6)
        return WorkerSpec(nodes=self.nodes, weights=self.weights, draining=[self.nodes[k] for k in self.draining],
                          sockets={n: f"unix:@amqpbroker-{os.getpid()}-{token}-{n}" for n in self.nodes},
                          secret=secrets.token_hex(32), port=port, node_ports=node_ports,
                          gate=str(self.gate.path))

    def run(self) -> int:
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            holder = reserve_port(s.host, s.port)
        except OSError as exc:
            log.error("cannot start: port %s:%d: %s", s.host, s.port, exc)
            return 2
        port = holder.getsockname()[1]
        refusal = self._unserved_stores()
        if refusal is not None:
            log.error("cannot start: %s", refusal)
            return 2
        self._add_draining()
        # Each worker's own port too (redirects name it): held the same way.
        own = [reserve_port(s.host, 0) for _ in self.nodes]
        spec_path = s.data_dir / "workers.json"
        self.node_ports = {n: o.getsockname()[1] for n, o in zip(self.nodes, own)}
        self.gate = StartGate(s.data_dir / "start-gate").reset()
        self.spec(port, self.node_ports).write(spec_path)
        self.spec_path = spec_path
        log.info("supervisor: %d workers on port %d (data in %s/node-K)", self.serving, port, s.data_dir)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGHUP, self._reload)
        self._start_all()
        while not self.stopping:
            self._reap()
            time.sleep(0.1)
        self._stop_all()
        holder.close()
        for sock in own:
            sock.close()
        return self.exit_code

    def _unserved_stores(self) -> str | None:
        """Why this data dir must not be served by these workers: it holds a single
        broker's store (store/layout.py), which they would not open, so its messages
        would be hidden."""
        data_dir = self.settings.data_dir
        single = single_store(data_dir)
        if single is not None:
            return (f"{single} holds a single broker's store, which `--workers` does not open: start without "
                    f"--workers, or move it to {data_dir / 'node-0' / 'store'} for node n0 to take (its queues "
                    f"then move to their owners, and its durable subscriptions to their topics' nodes)")
        return None

    def _add_draining(self) -> None:
        """`node-K` stores with K >= N (a start with fewer workers than before): each
        is run as a node of weight 0 (it owns nothing, so the map is the N nodes') that
        never serves a client: its subscriptions move before the gate opens, its queues
        after, and once it holds no message it stops (EXIT_DRAINED) and its directory
        is set aside (`node-K.drained-<time>`)."""
        stray = [k for k in worker_stores(self.settings.data_dir) if k >= len(self.nodes)]
        if not stray:
            return
        extra = [f"n{k}" for k in range(len(self.nodes), stray[-1] + 1)]
        self.nodes = self.nodes + extra
        self.weights = dict(self.weights, **{n: 0 for n in extra})
        self.draining = set(stray)
        log.info("supervisor: emptying the store(s) of %s into the %d worker(s) (their messages and durable "
                 "subscriptions move to their owners)", ", ".join(f"node-{k}" for k in stray),
                 self.serving)

    def _drained(self, index: int) -> None:
        path = self.settings.data_dir / f"node-{index}"
        aside = path.with_name(f"{path.name}.drained-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            path.rename(aside)
        except OSError as exc:   # it is empty: the next start with N workers drains it again (nothing)
            log.warning("supervisor: node-%d holds nothing more, but could not be set aside: %s", index, exc)
            return
        log.info("supervisor: node-%d holds nothing more: its directory is kept as %s (delete it when you like)",
                 index, aside)

    def _start_all(self) -> None:
        """Every node behind the start gate (cluster/gate.py), which opens once each
        has recovered its store and moved the subscriptions the map took from it to
        their topics' nodes (cluster/moves.py): until then no node serves a client,
        so a moved subscription misses no message.  The nodes that have a store start
        first; those whose store would be new only once those have recovered (or
        exited): a node that refuses this map (EXIT_REFUSED) then leaves no new store
        behind, which a start with the previous --workers would have to refuse as
        stranded.  A node that exits meanwhile is started again and waited for, unless
        it fails again and again (then it finds the gate open, and refuses to start if
        it still holds something to move: nothing moves while clients are served)."""
        have = set(worker_stores(self.settings.data_dir))
        run = list(range(self.serving)) + sorted(self.draining)
        first = [i for i in run if i in have]
        later = [i for i in run if i not in have]
        for i in first:
            self._start(i)
        self._wait_for(first if later else [], "recovered")
        if not self.stopping:
            for i in later:
                self._start(i)
        self._wait_for(run, "ready")
        if not self.stopping:
            self.gate.open()
            log.info("supervisor: every worker is ready; serving clients")

    def _wait_for(self, indexes: Any, state: str) -> None:
        """Until each node is in `state`, or exited and started again so often that its
        restart delay is at its longest (it is not waited for any more)."""
        pending = set(indexes)
        said = time.monotonic()
        while pending and not self.stopping:
            self._reap()
            pending = {i for i in pending if self.restarts.get(i, 0) < MAX_RESTART_DELAY
                       and not self.gate.has(self.nodes[i], state)}
            if pending and time.monotonic() - said >= WAITING_NOTE:   # why nothing listens yet
                said = time.monotonic()
                log.info("supervisor: no client is served until %s %s (their logs say what they do)",
                         ", ".join(self.nodes[i] for i in sorted(pending)),
                         "are ready" if state == "ready" else "have recovered their stores")
            if pending:
                time.sleep(0.05)

    def _start(self, index: int) -> None:
        cmd = [sys.executable, "-m", "amqpbroker.cli"] + self.argv + [
            "--worker", str(index), "--worker-spec", str(self.spec_path)]
        self.procs[index] = subprocess.Popen(cmd, preexec_fn=_die_with_parent)

    def _reap(self) -> None:
        for index, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self.stopping:
                continue
            if code == EXIT_DRAINED and index in self.draining:
                del self.procs[index]
                self.draining.discard(index)
                self._drained(index)
                continue
            if code == EXIT_REFUSED:   # its log line says why; starting it again would not help
                log.error("supervisor: worker %s refused to start with this map; stopping every worker",
                          self.nodes[index])
                del self.procs[index]
                self.stopping, self.exit_code = True, EXIT_REFUSED
                return
            if code == EXIT_CANNOT_START and not self.gate.has(self.nodes[index], "serving"):
                self.refusals[index] = self.refusals.get(index, 0) + 1
                if self.refusals[index] >= START_REFUSALS:   # its log line says why: the same each time
                    log.error("supervisor: worker %s cannot start (exit %d, %d times, never serving yet); "
                              "stopping every worker", self.nodes[index], code, self.refusals[index])
                    del self.procs[index]
                    self.stopping, self.exit_code = True, EXIT_CANNOT_START
                    return
            delay = min(MAX_RESTART_DELAY, self.restarts.get(index, RESTART_DELAY / 2) * 2)
            self.restarts[index] = delay
            log.warning("supervisor: worker %s exited (%s); starting it again in %.1f s",
                        self.nodes[index], code, delay)
            del self.procs[index]
            time.sleep(delay)
            if not self.stopping:
                self._start(index)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _reload(self, signum: int, frame: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGHUP)

    def _stop_all(self, grace: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.info("supervisor: every worker stopped")


def _die_with_parent() -> None:
    """A worker must not outlive its supervisor (kill -9 of the supervisor included):
    it would hold the port and its store with nobody to stop it."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(settings: Settings, count: int, weights: str | None, argv: list[str]) -> int:
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warning = crowding(count, usable_cores())
    if warning:
        log.warning(warning)
    return Supervisor(settings, count, weights, argv).run()


__all__ = ["supervise", "worker_count", "parse_weights", "check_options", "Path"]
