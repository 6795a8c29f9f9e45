"""A real amqpbroker for your own tests.

    from amqpbroker.testing import running_broker

    with running_broker() as broker:          # free port, temporary data directory
        connect_your_code_to(broker.url)      # amqp://127.0.0.1:<port>
        assert broker.admin.queue_depth("orders") == 1

With pytest the plugin (registered through the `pytest11` entry point, so installing
amqpbroker is enough) gives the `amqp_broker` fixture, see `amqpbroker.testing.plugin`.

Two modes:

* ``"inprocess"`` (default): the broker runs on a background thread with its own asyncio
  event loop, in the test process. Fast to start, and `admin` can read broker state.
* ``"subprocess"``: `amqpbroker serve` in a child process, exactly as deployed; the
  settings travel as ``AMQPBROKER_*`` environment variables. `admin` is not available.

Settings are the broker's own (`amqpbroker.config.Settings`); pass overrides as keywords:
``running_broker(policy={"max_delivery_attempts": 3}, queues=[{"name": "orders"}])``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["AmqpBroker", "BrokerAdmin", "BrokerStartError", "running_broker", "INPROCESS", "SUBPROCESS"]

INPROCESS = "inprocess"
SUBPROCESS = "subprocess"
_LISTEN_RE = re.compile(r"amqp listening on (\S+):(\d+)")
_MANAGEMENT_RE = re.compile(r"management listening on (\S+):(\d+) \((https?)\)")
T = TypeVar("T")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class BrokerStartError(RuntimeError):
    """The broker did not start (bad settings, port in use, …); the message says why."""


class BrokerAdmin:
    """Reads and changes broker state from the test thread.  Every call runs on the
    broker's event loop (`loop.call_soon_threadsafe` + a future), so it never races the
    broker; it waits at most `timeout` seconds."""

    def __init__(self, owner: "AmqpBroker", timeout: float = 10.0):
        self._owner = owner
        self.timeout = timeout

    def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(server)` on the broker loop (server: `amqpbroker.server.app.BrokerServer`)
        and return its result: the escape hatch for state these helpers do not cover."""
        loop, server = self._owner._loop, self._owner._server
        if self._owner.mode != INPROCESS:
            raise RuntimeError("broker admin needs mode='inprocess' (a subprocess broker has no admin API yet)")
        if loop is None or server is None or not loop.is_running():
            raise RuntimeError("the broker is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(server))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return fut.result(self.timeout)

    def queues(self) -> list[str]:
        """Names of every queue, sorted (subscription queues included)."""
        return self.call(lambda s: sorted(s.broker.queues))

    def queue_depth(self, name: str) -> int:
        """Messages the queue holds: ready, scheduled and delivered-but-unsettled.
        KeyError when there is no such queue."""
        def depth(s: Any) -> int:
            queue = s.broker.queues.get(name)
            if queue is None:
                raise KeyError(f"no queue named {name!r} (queues: {sorted(s.broker.queues)})")
            return queue.depth
        return self.call(depth)

    def purge(self, name: str) -> int:
        """Drop the queue's waiting messages (not those delivered and unsettled);
        return how many went.  KeyError when there is no such queue."""
        def purge(s: Any) -> int:
            queue = s.broker.queues.get(name)
            if queue is None:
                raise KeyError(f"no queue named {name!r}")
            return queue.purge()
        return self.call(purge)

    def subscriptions(self) -> list[dict]:
        """JMS subscriptions (durable, shared, …): namespace (client-id or `_global_`),
        name, durable, shared, queue, consumers, links, address/key."""
        def subs(s: Any) -> list[dict]:
            out = []
            for key, sub in s.subscriptions.subscriptions.items():
                queue = s.broker.queues.get(sub.queue_name)
                out.append({"namespace": key.namespace, "name": key.name, "durable": key.durable,
                            "shared": sub.shared, "queue": sub.queue_name,
                            "consumers": len(queue.consumers) if queue else 0,
                            "depth": queue.depth if queue else 0,
                            "links": sorted(sub.links), "exchange": sub.binding.exchange,
                            "key": sub.binding.key, "selector": sub.binding.selector})
            return sorted(out, key=lambda d: (d["namespace"], d["name"]))
        return self.call(subs)

    def connections(self) -> int:
        """Open AMQP connections."""
        return self.call(lambda s: s.connection_count)


class AmqpBroker:
    """One broker for tests: `start()`, `stop()`, `restart()`; `url`, `host`, `port`,
    `data_dir`, `settings`, `admin`.  Also a context manager."""

    def __init__(self, *, mode: str = INPROCESS, data_dir: str | os.PathLike | None = None,
                 host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0,
                 stop_grace: float = 2.0, **settings_overrides: Any):
        if mode not in (INPROCESS, SUBPROCESS):
            raise ValueError(f"mode must be {INPROCESS!r} or {SUBPROCESS!r}, not {mode!r}")
        self.mode = mode
        self._own_dir: Path | None = None
        if data_dir is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix="amqpbroker-test-"))
            data_dir = self._own_dir / "data"
        self.data_dir = Path(data_dir)
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        settings_overrides.setdefault("management", {"port": 0})   # free port: test brokers side by side
        from ..config import ConfigError, Settings, load_settings
        if "management" in Settings.model_fields and "management" not in settings_overrides:
            # the management listener (REST API, /metrics) on a free port too, so that
            # several test brokers can run at once
            settings_overrides["management"] = {"port": 0}
        self._overrides = dict(settings_overrides)
        try:
            self.settings = load_settings(None, host=host, port=port, data_dir=self.data_dir,
                                          **settings_overrides)
        except ConfigError as exc:
            raise BrokerStartError(str(exc)) from None
        self.host = self.settings.host
        self.port: int | None = None
        self.management_url: str | None = None   # http(s)://host:port of the management API, when on
        self.admin = BrokerAdmin(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._proc: subprocess.Popen | None = None
        self._log: list[str] = []

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the broker is not started")
        return f"amqp://{_host_for_url(self.host)}:{self.port}"

    @property
    def running(self) -> bool:
        if self.mode == INPROCESS:
            return self._server is not None
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        where = self.url if self.port is not None else "stopped"
        return f"<AmqpBroker {self.mode} {where} data={self.data_dir}>"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "AmqpBroker":
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.mode == INPROCESS:
            self._start_inprocess()
        else:
            self._start_subprocess()
        return self

    def stop(self) -> None:
        """Stop the broker (connections are closed with amqp:connection:forced).  The data
        directory stays until `close()` (restart() needs it)."""
        if self.mode == INPROCESS:
            self._stop_inprocess()
        else:
            self._stop_subprocess()

    def restart(self) -> "AmqpBroker":
        """Stop and start again on the same data directory and, if it is still free, the
        same port (durable queues and their messages survive; clients must reconnect)."""
        port = self.port
        self.stop()
        if port:
            self.settings = self.settings.model_copy(update={"port": port})
            try:
                return self.start()
            except BrokerStartError:
                self.settings = self.settings.model_copy(update={"port": 0})
        return self.start()

    def close(self) -> None:
        """Stop, and remove the data directory if this object made it."""
        self.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> "AmqpBroker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def log_text(self) -> str:
        """A subprocess broker's log (stderr) so far; empty in-process (it logs through
        the `amqpbroker` logger, which pytest captures)."""
        return "".join(self._log)

    # ------------------------------------------------------------------ in-process

    def _start_inprocess(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name=f"amqpbroker-{id(self):x}", daemon=True)
        thread.start()
        ready.wait(self.start_timeout)
        self._loop, self._thread = loop, thread

        async def boot() -> Any:
            from ..server.app import BrokerServer
            server = BrokerServer(self.settings, loop)
            try:
                await server.start()
            except BaseException:
                try:  # release what did start (store, management listener, timers)
                    await server.stop(grace=0)
                except Exception:  # noqa: BLE001 - the start error is what matters
                    pass
                raise
            return server

        try:
            server = asyncio.run_coroutine_threadsafe(boot(), loop).result(self.start_timeout)
        except BaseException as exc:
            self._shutdown_loop()
            raise BrokerStartError(f"broker did not start: {type(exc).__name__}: {exc}") from exc
        self._server = server
        self.port = next(lst.port for lst in server.listeners if lst.name == "amqp")
        ops = getattr(server, "operations", None)
        if ops is not None and getattr(ops, "port", None):
            m = self.settings.management
            scheme = "https" if m.cert_file else "http"
            self.management_url = f"{scheme}://{_host_for_url(ops.host)}:{ops.port}"

    def _stop_inprocess(self) -> None:
        server, loop = self._server, self._loop
        if server is not None and loop is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(server.stop(grace=self.stop_grace), loop)
            try:
                fut.result(self.stop_grace + 15)
            except concurrent.futures.TimeoutError:
                pass
        self._server = None
        self.management_url = None
        self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None:
            if loop.is_running():
                loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(10)
            if not loop.is_running():
                loop.close()
        self._loop = self._thread = None

    # ------------------------------------------------------------------ subprocess

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        dumped = self.settings.model_dump(mode="json")
        for key in self._overrides:
            value = dumped.get(key)
            if value is None or key in ("host", "port", "data_dir", "log_level"):
                continue
            env[f"AMQPBROKER_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def _start_subprocess(self) -> None:
        s = self.settings
        cmd = [sys.executable, "-m", "amqpbroker.cli", "serve", "--host", s.host, "--port", str(s.port),
               "--data-dir", str(self.data_dir), "--log-level", s.log_level]
        self._log = []
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=self._env())
        found: dict[str, int] = {}
        cond = threading.Condition()

        def read() -> None:
            for line in proc.stderr:
                with cond:
                    self._log.append(line)
                    m = _LISTEN_RE.search(line)
                    if m and "port" not in found:
                        found["port"] = int(m.group(2))
                    m = _MANAGEMENT_RE.search(line)
                    if m:
                        self.management_url = f"{m.group(3)}://{_host_for_url(m.group(1))}:{m.group(2)}"
                    cond.notify_all()
            with cond:
                cond.notify_all()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        with cond:
            while "port" not in found:
                if proc.poll() is not None:
                    raise BrokerStartError("broker exited during start-up:\n" + self.log_text())
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    proc.wait()
                    raise BrokerStartError("broker did not start in time:\n" + self.log_text())
                cond.wait(min(left, 0.5))
        self._proc = proc
        self.port = found["port"]

    def _stop_subprocess(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_grace + 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None


@contextmanager
def running_broker(*, mode: str = INPROCESS, data_dir: str | os.PathLike | None = None,
                   **settings_overrides: Any) -> Iterator[AmqpBroker]:
    """A started broker for the `with` block: free port, temporary data directory
    (removed afterwards unless `data_dir` was given), stopped at the end."""
    broker = AmqpBroker(mode=mode, data_dir=data_dir, **settings_overrides)
    broker.start()
    try:
        yield broker
    finally:
        broker.close()
