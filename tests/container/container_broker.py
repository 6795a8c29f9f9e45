"""The broker image run through testcontainers, with the same interface as
tests.broker_process.BrokerProcess (url, port, log_text, wait_for_log, stop)."""

from __future__ import annotations

import os
import re
import socket
import time

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")       # the reaper image can't be pulled here
os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "docker_host")

IMAGE = os.environ.get("AMQPBROKER_IMAGE", "amqpbroker:local")


def engine_problem() -> str | None:
    """None when a container engine with the broker image is usable, else why not."""
    try:
        import docker
    except ImportError:
        return "the docker client library is not installed"
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # no socket, engine not running …
        return f"no container engine is running ({exc.__class__.__name__})"
    try:
        client.images.get(IMAGE)
    except Exception:
        return f"image {IMAGE} is not built (scripts/containers.sh build)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ContainerBroker:
    """The broker image on the host network (the only networking the CI engine has)."""

    def __init__(self, env: dict | None = None, volume: str | None = None):
        from testcontainers.core.container import DockerContainer

        self.host = "127.0.0.1"
        self.port = free_port()
        self.ports = {"amqp": self.port}
        c = (DockerContainer(IMAGE).with_kwargs(network_mode="host")
             .with_env("AMQPBROKER_HOST", self.host).with_env("AMQPBROKER_PORT", str(self.port))
             .with_env("AMQPBROKER_ALLOW_ANONYMOUS", "true").with_env("AMQPBROKER_LOG_LEVEL", "debug")
             .with_env("AMQPBROKER_MANAGEMENT__ENABLED", "false"))
        for k, v in (env or {}).items():
            c = c.with_env(k, v)
        if volume is not None:
            c = c.with_volume_mapping(volume, "/data", "rw")
        self.container = c

    @property
    def url(self) -> str:
        return f"amqp://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ContainerBroker":
        self.container.start()
        self.wait_for_log(r"amqp listening on", timeout)
        return self

    def log_text(self) -> str:
        out, err = self.container.get_logs()
        return (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_text().splitlines():
                if rx.search(line):
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line matching {pattern!r}:\n{self.log_text()[-3000:]}")
            time.sleep(0.1)   # polling the engine's log API; there is no push

    def exec(self, *cmd: str) -> tuple[int, str]:
        result = self.container.get_wrapped_container().exec_run(list(cmd))
        return result.exit_code, result.output.decode(errors="replace")

    def health(self) -> str:
        wrapped = self.container.get_wrapped_container()
        wrapped.reload()
        return wrapped.attrs.get("State", {}).get("Health", {}).get("Status", "none")

    def stop(self) -> None:
        self.container.stop()
