"""A real ZooKeeper and real broker processes for the HA tests (docs/ha.md).

ZooKeeper is the Debian package's server (apt package `zookeeper`), started here on
a free port in a temporary directory with a generated zoo.cfg (tickTime 200 ms, so
a 2 s session timeout is allowed and expiry is checked often).  When the package is
missing, `zookeeper_jar()` installs it with apt-get when it can; in CI (CI set in
the environment) a ZooKeeper that cannot be had is a failure, elsewhere the tests
are skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.broker_process import follow_log

ZK_JAR = Path("/usr/share/java/zookeeper.jar")
ZK_CONF = Path("/etc/zookeeper/conf")        # log4j.properties of the package
SESSION_TIMEOUT = 2.0
SECRET = "test-pair-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install_zookeeper() -> str | None:
    """apt-get install zookeeper; None when done, else why not."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        return "not root and no sudo"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-qq", "--no-install-recommends",
                 "zookeeper"]):
        done = subprocess.run(sudo + cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}"
    return None


def _unavailable(message: str) -> None:
    """ZooKeeper cannot be had here: a skip with the reason on a developer's machine,
    a failure under CI (.ci/run sets CI), where the HA tests must run."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def zookeeper_jar() -> Path:
    if not ZK_JAR.exists():
        why = _install_zookeeper()
        if why is not None or not ZK_JAR.exists():
            _unavailable(f"the Debian zookeeper package is not installed and cannot be: {why}")
    if shutil.which("java") is None:
        _unavailable("no java on this machine (ZooKeeper needs one)")
    return ZK_JAR


class ZooKeeper:
    def __init__(self, workdir: Path, tick_time_ms: int = 200):
        self.dir = workdir
        self.tick_time_ms = tick_time_ms   # sessions from 2 to 100 ticks are granted
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ZooKeeper":
        jar = zookeeper_jar()
        self.port = free_port()
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "zoo.cfg"
        tick = self.tick_time_ms
        cfg.write_text(f"tickTime={tick}\ndataDir={self.dir / 'data'}\nclientPort={self.port}\n"
                       f"clientPortAddress=127.0.0.1\nminSessionTimeout={2 * tick}\nmaxSessionTimeout={100 * tick}\n"
                       "admin.enableServer=false\n4lw.commands.whitelist=ruok,dump\n")
        cp = f"{ZK_CONF}:{jar}" if ZK_CONF.exists() else str(jar)
        log = open(self.dir / "zookeeper.log", "w")
        self.proc = subprocess.Popen(["java", "-Xmx256m", "-cp", cp, f"-Dzookeeper.log.dir={self.dir}",
                                      "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ZooKeeper exited:\n" + (self.dir / "zookeeper.log").read_text()[-2000:])
            if self.ruok():
                return self
            time.sleep(0.1)
        raise RuntimeError("ZooKeeper did not start in 30 s")

    def ruok(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(4) == b"imok"
        except OSError:
            return False

    def sessions(self, looks: int = 3) -> set[str]:
        """The ids of the sessions ZooKeeper keeps now (the `dump` four-letter word's
        session sets): a test sees a session expire when its id leaves the set.

        One dump can miss a live session: ZooKeeper lists its expiry buckets from a copy
        of their keys, and a session touched meanwhile moves to a bucket the copy does not
        hold. So this is the union of a few dumps a moment apart; a session is gone only
        when none of them lists it."""
        found: set[str] = set()
        for look in range(looks):
            if look:
                time.sleep(0.05)
            found |= self._dumped_sessions()
        return found

    def _dumped_sessions(self) -> set[str]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"dump")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace")
        head, _, _ = text.partition("ephemeral nodes dump")
        return set(re.findall(r"^\s+(0x[0-9a-f]+)\s*$", head, re.M))

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


def pair_config(zk: ZooKeeper, cluster: str, role: str, amqp_port: int, defaults: bool = False, **extra) -> str:
    """A pair's broker; `defaults`: the shipped session and backup timeouts, not the tests' shorter ones."""
    lines = [f'port = {amqp_port}', "[ha]", f'role = "{role}"', f'zookeeper = "{zk.hosts}"',
             f'cluster = "{cluster}"', "replication_port = 0", f'secret = "{SECRET}"']
    if not defaults:
        lines += [f"zookeeper_session_timeout = {SESSION_TIMEOUT}", "backup_timeout = 2.0"]
    lines += [f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {str(v).lower()}"
              for k, v in extra.items()]
    return "\n".join(lines) + "\n"


class HaBroker:
    """One broker of a pair as a process: started with a fixed AMQP port (clients fail
    over between known addresses); `wait_live()` blocks until its listener is open."""

    def __init__(self, name: str, data_dir: Path, config: str, amqp_port: int):
        self.name = name
        self.data_dir = Path(data_dir)
        self.config = config
        self.amqp_port = amqp_port
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.ports: dict[str, int] = {}
        self.extra_env: dict[str, str] = {}
        self._cond = threading.Condition()

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.amqp_port}"

    def start(self, wait: bool = True) -> "HaBroker":
        """Start the process; with `wait`, until it logs that it is the backup or live."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.data_dir.parent / f"{self.name}.toml"
        cfg.write_text(self.config)
        env = {**os.environ, "AMQPBROKER_MANAGEMENT__PORT": "0", **self.extra_env}
        self.lines, self.ports = [], {}
        self.proc = subprocess.Popen([sys.executable, "-m", "amqpbroker.cli", "serve", "--config", str(cfg),
                                      "--data-dir", str(self.data_dir), "--log-level", "info"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        if wait:
            self.wait_for_log(r"ha: (backup:|node \S+ is live)", 30)
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        follow_log(self, proc)

    def log_text(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout: float = 15.0, after: int = 0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[after:]:
                    if rx.search(line):
                        return line
                if self.proc.poll() is not None and not any(rx.search(x) for x in self.lines[after:]):
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before /{pattern}/:\n"
                                       + "".join(self.lines[-60:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no /{pattern}/ in {timeout} s:\n" + "".join(self.lines[-60:]))
                self._cond.wait(min(left, 0.2))

    def wait_live(self, timeout: float = 20.0) -> None:
        self.wait_for_log(r"amqp listening on", timeout)

    def is_listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.amqp_port), timeout=0.5):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
