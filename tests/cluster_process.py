"""A real cluster for end-to-end tests: `amqpbroker serve --workers N` as a process
(the supervisor and its N node processes), with the same face as BrokerProcess so
that a test written for one broker runs unchanged against a cluster.

By default the first node owns no slot (`--worker-weights 0,1,1`): a client on its
own port (`port`, `url`) reaches a node that owns nothing it uses, so every link is
forwarded to another node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.broker_process import follow_log

NODE_RE = re.compile(r"amqp-node listening on ([\d.]+):(\d+) \(node (\S+)\)")
PID_RE = re.compile(r"\[(n\d+) pid (\d+)\]")
MGMT_RE = re.compile(r"\[(n\d+)\] .*management listening on [\d.]+:(\d+)")


class ClusterProcess:
    # A dead letter reaches the dead-letter queue's owner through a shovel
    # (cluster/shovel.py), a hop after the death: readers of it wait this long for
    # the first one (tests/e2e/helpers_delivery.py dead_letters).
    dead_letter_wait = 10.0

    def __init__(self, data_dir: Path, workers: int = 3, weights: str | None = "0,1,1",
                 config: str | None = None, env: dict | None = None):
        self.data_dir = Path(data_dir)
        self.workers = workers
        self.weights = weights
        self.config_text = config
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.host = "127.0.0.1"
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    @property
    def config_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}-cluster.toml"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir", str(self.data_dir),
               "--log-level", "debug", "--workers", str(self.workers)]
        if self.weights:
            cmd += ["--worker-weights", self.weights]
        if self.config_text is not None:
            self.config_path.write_text(self.config_text)
            cmd += ["--config", str(self.config_path)]
        return cmd

    def start(self, timeout: float = 40.0, wait: bool = True) -> "ClusterProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **self.extra_env)
        env.setdefault("AMQPBROKER_MANAGEMENT__PORT", "0")
        self.lines, self.ports = [], {}
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        threading.Thread(target=follow_log, args=(self, self.proc), daemon=True).start()
        if not wait:
            return self
        try:
            self.wait_nodes(timeout)
        except BaseException:
            self.stop()   # nothing left running behind a failed start
            raise
        return self

    def nodes(self) -> dict[str, int]:
        """node → its own AMQP port (the latest start of each)."""
        with self._lock:
            found = {}
            for line in self.lines:
                m = NODE_RE.search(line)
                if m:
                    found[m.group(3)] = int(m.group(2))
            return found

    def management_ports(self) -> dict[str, int]:
        """node → its management listener's port (each node has its own)."""
        with self._lock:
            found = {}
            for line in self.lines:
                m = MGMT_RE.search(line)
                if m:
                    found[m.group(1)] = int(m.group(2))
            return found

    def get(self, node: str, path: str) -> str:
        """GET `path` on a node's management listener (anonymous on loopback)."""
        import urllib.request
        url = f"http://127.0.0.1:{self.management_ports()[node]}{path}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()

    def wait_nodes(self, timeout: float = 40.0, after: int = 0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                up = {m.group(3) for line in self.lines[after:] for m in [NODE_RE.search(line)] if m}
                if len(up) >= (self.workers if after == 0 else 1):
                    return
                if self.proc.poll() is not None:
                    raise RuntimeError("cluster exited during start-up:\n" + "".join(self.lines[-60:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("cluster did not start in time:\n" + "".join(self.lines[-60:]))
                self._cond.wait(min(left, 0.2))

    @property
    def owners(self) -> tuple[str, ...]:
        """The static slot map of the workers (core/placement.py)."""
        from amqpbroker.core.placement import static_map
        names = [f"n{i}" for i in range(self.workers)]
        weights = dict(zip(names, [int(w) for w in (self.weights or ",".join("1" * self.workers)).split(",")]))
        return static_map(names, weights).owners

    @property
    def port(self) -> int:
        """The port of node n0 (owns nothing when weighted 0)."""
        return self.nodes()["n0"]

    @property
    def shared_port(self) -> int:
        return self.ports["amqp"]

    @property
    def url(self) -> str:
        return f"amqp://{self.host}:{self.port}"

    def node_url(self, node: str) -> str:
        return f"amqp://{self.host}:{self.nodes()[node]}"

    def worker_pid(self, node: str) -> int:
        """The process id of a node (from `ps`: the supervisor's child running --worker K)."""
        index = node[1:]
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "--", f"--worker {index} "],
                             capture_output=True, text=True).stdout.split()
        if not out:
            raise RuntimeError(f"no process for node {node}")
        return int(out[0])

    def kill_node(self, node: str) -> None:
        """kill -9 of one node; the supervisor starts it again on its data dir."""
        os.kill(self.worker_pid(node), signal.SIGKILL)

    def log_text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout: float = 10.0, after: int = 0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[after:]:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no log line matching {pattern!r}:\n" + "".join(self.lines[-40:]))
                self._cond.wait(left)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


class ZkCluster:
    """A `[cluster]` of three broker processes (a, b, c; a owns nothing) and a real
    ZooKeeper (tests/e2e/ha_harness.py), with the same face as BrokerProcess: `port`
    and `url` are node a's, the log is every node's."""

    SECRET = "cluster-test-secret-0123456789"

    # A dead letter reaches the dead-letter queue's owner through a shovel
    # (cluster/shovel.py), a hop after the death: readers of it wait this long for
    # the first one (tests/e2e/helpers_delivery.py dead_letters).
    dead_letter_wait = 10.0

    def __init__(self, base: Path, config: str | None = None, nodes: tuple[str, ...] = ("a", "b", "c"),
                 weights: str = "{ a = 0 }", cluster_extra: str = "", node_extra: dict[str, str] | None = None):
        self.base = Path(base)
        self.config_text = config or ""
        self.cluster_extra = cluster_extra   # more [cluster] keys (one per line)
        self.node_extra = node_extra or {}   # node → its own [cluster] keys (listen_port, advertised …)
        self.node_names = nodes
        self.weights = weights
        self.host = "127.0.0.1"
        self.zk = None
        self.members: dict = {}
        self.name = f"c{uuid4hex()}"

    def member_config(self, node: str) -> str:
        nodes = ", ".join(f'"{n}"' for n in self.node_names)
        own = self.node_extra.get(node, "")
        port = "" if "listen_port" in own else "listen_port = 0\n"
        return (self.config_text + "\n[cluster]\n"
                f'zookeeper = "{self.zk.hosts}"\nzookeeper_session_timeout = 4.0\nname = "{self.name}"\n'
                f'node_id = "{node}"\nnodes = [{nodes}]\nweights = {self.weights}\n{port}'
                f'secret = "{self.SECRET}"\n' + self.cluster_extra + own)

    def start(self) -> "ZkCluster":
        try:
            return self._start()
        except BaseException:
            self.stop()   # nothing left running behind a failed start (or a skip)
            raise

    def _start(self) -> "ZkCluster":
        from tests.broker_process import BrokerProcess
        from tests.e2e.ha_harness import ZooKeeper, zookeeper_jar
        zookeeper_jar()   # skips (or fails under CI) when ZooKeeper cannot be had
        (self.base / "zk").mkdir(parents=True, exist_ok=True)
        self.zk = ZooKeeper(self.base / "zk").start()
        for node in self.node_names:
            self.members[node] = BrokerProcess(self.base / node, config=self.member_config(node))
        for proc in self.members.values():
            proc.start(timeout=40)
        for node, proc in self.members.items():
            proc.wait_for_log(rf"cluster: node {node} is live", timeout=20)
        for proc in self.members.values():   # every node has seen every other
            for node in self.node_names:
                proc.wait_for_log(rf"cluster: node {node} is live", timeout=20)
        return self

    @property
    def owners(self) -> tuple[str, ...]:
        """The slot map the nodes made in ZooKeeper from their configuration."""
        from amqpbroker.core.placement import static_map
        return static_map(self.node_names, {self.node_names[0]: 0}).owners

    @property
    def port(self) -> int:
        return self.members[self.node_names[0]].port

    @property
    def url(self) -> str:
        return f"amqp://{self.host}:{self.port}"

    def node_url(self, node: str) -> str:
        return self.members[node].url

    def log_text(self) -> str:
        return "".join(p.log_text() for p in self.members.values())

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for proc in self.members.values():
                for line in proc.log_text().splitlines():
                    if rx.search(line):
                        return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line matching {pattern!r} on any node")
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.members.values():
            proc.stop()
        if self.zk is not None:
            self.zk.stop()


def uuid4hex() -> str:
    import uuid
    return uuid.uuid4().hex[:8]


CLUSTER_KINDS = ["alone", "workers", "zookeeper"]


def broker_or_cluster(kind: str, tmp_path_factory, config: str | None = None, name: str = "broker"):
    """A module fixture's body: one broker, or a cluster reached through a node that
    owns nothing (`serve --workers 3`, or three `[cluster]` nodes and a ZooKeeper):
    the JMS wire tests run against each."""
    from tests.broker_process import BrokerProcess
    base = tmp_path_factory.mktemp(f"{name}-{kind}")
    if kind == "workers":
        proc = ClusterProcess(base / "data", config=config)
    elif kind == "zookeeper":
        proc = ZkCluster(base, config=config)
    else:
        proc = BrokerProcess(base / "data", config=config)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def colocated(broker, name: str, prefix: str) -> str:
    """A fresh queue name held by the same node as queue `name` (a transaction may use
    one node's addresses only, docs/cluster.md); on one broker, any fresh name."""
    import uuid
    from amqpbroker.core.placement import slot_of
    owners = getattr(broker, "owners", None)
    while True:
        other = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if owners is None or owners[slot_of(other)] == owners[slot_of(name)]:
            return other
