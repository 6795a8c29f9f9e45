"""Start the real broker as a subprocess for end-to-end tests.

The broker is started with `--port 0`; the port is read from its log line
"amqp listening on HOST:PORT", so no port guessing and no sleeps.
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

LISTEN_RE = re.compile(r"(amqps?|wss?|management) listening on ([\d.]+):(\d+)")


class BrokerProcess:
    def __init__(self, data_dir: Path, config: str | None = None, env: dict | None = None,
                 args: list[str] | None = None):
        self.data_dir = Path(data_dir)
        self.config_text = config
        self.extra_env = env or {}
        self.extra_args = args or []
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.host = "127.0.0.1"
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    # ------------------------------------------------------------------ lifecycle

    @property
    def config_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}-broker.toml"

    def reload(self, config: str) -> None:
        """Write a new config file and send SIGHUP (live reload)."""
        self.config_path.write_text(config)
        self.proc.send_signal(signal.SIGHUP)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0",
               "--data-dir", str(self.data_dir), "--log-level", "debug"]
        if self.config_text is not None:
            cfg = self.config_path
            cfg.write_text(self.config_text)
            cmd += ["--config", str(cfg)]
        return cmd + self.extra_args

    def start(self, timeout: float = 20.0) -> "BrokerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.extra_env)
        env.setdefault("AMQPBROKER_MANAGEMENT__PORT", "0")   # never the fixed 8161 in tests
        self.ports = {}
        self.lines = []
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        with self._cond:
            while "amqp" not in self.ports:
                if self.proc.poll() is not None:
                    raise RuntimeError("broker exited during start-up:\n" + "".join(self.lines))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("broker did not start in time:\n" + "".join(self.lines))
                self._cond.wait(left)
            if self.config_text and "[tls]" in self.config_text:
                while "amqps" not in self.ports and time.monotonic() < deadline:
                    self._cond.wait(0.1)
            if self.config_text and "[websocket]" in self.config_text:
                while not ({"ws", "wss"} & set(self.ports)) and time.monotonic() < deadline:
                    self._cond.wait(0.1)
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        follow_log(self, proc)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown work."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> "BrokerProcess":
        self.stop()
        return self.start()

    # ------------------------------------------------------------------ helpers

    @property
    def port(self) -> int:
        return self.ports["amqp"]

    @property
    def url(self) -> str:
        return f"amqp://{self.host}:{self.port}"

    def log_text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> str:
        """Block until a log line matches `pattern` (regex); return that line."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no log line matching {pattern!r}:\n" + "".join(self.lines[-40:]))
                self._cond.wait(left)


def follow_log(owner, proc: subprocess.Popen) -> None:
    """A reader thread's body: every log line of `proc` into `owner.lines`, the
    listeners' ports into `owner.ports` (both under `owner._cond`, notified)."""
    for line in proc.stderr:
        with owner._cond:
            owner.lines.append(line)
            m = LISTEN_RE.search(line)
            if m:
                owner.ports[m.group(1)] = int(m.group(3))
            owner._cond.notify_all()
    # EOF: the process is ending; wake a waiter so that it sees the exit at once
    # (not at its timeout).
    proc.wait()
    with owner._cond:
        owner._cond.notify_all()
