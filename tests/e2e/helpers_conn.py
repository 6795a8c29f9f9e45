"""Helpers for the connection / security / CLI end-to-end tests.

`RawClient` drives a python-qpid-proton engine (Transport + Connection + Collector)
over a plain socket, synchronously, so a test sees exactly what the broker sent:
the Open's properties and capabilities even when the connection is refused, the
Close/End/Detach conditions, the negotiated frame size, the heartbeat counters.
It only does I/O while a test calls `pump`/`wait`, which is also how a test plays
a peer that has gone silent (it simply stops pumping).
"""

from __future__ import annotations

import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from proton import Collector, Connection, Data, Described, Endpoint, SASL, Transport, symbol, ulong

LOCAL_UNINIT = Endpoint.LOCAL_UNINIT
REMOTE_ACTIVE = Endpoint.REMOTE_ACTIVE
REMOTE_CLOSED = Endpoint.REMOTE_CLOSED


class RawClient:
    def __init__(self, host: str, port: int, *, container_id: str = "raw-client",
                 desired_capabilities: list[str] | None = None, sasl_mechs: str | None = "ANONYMOUS",
                 user: str | None = None, password: str | None = None,
                 idle_timeout: float | None = None, open: bool = True, source: str | None = None):
        # `source`: another loopback address (127.0.0.2 ...) to connect from, for
        # tests of per-address limits.
        self.sock = socket.create_connection((host, port), timeout=5,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # as AMQP clients do
        self.sock.setblocking(False)
        self.transport = Transport(Transport.CLIENT)
        if idle_timeout:
            self.transport.idle_timeout = idle_timeout
        if sasl_mechs is not None:
            sasl = self.transport.sasl()
            sasl.allowed_mechs(sasl_mechs)
            sasl.allow_insecure_mechs = True
        self.conn = Connection()
        self.conn.container = container_id
        self.conn.hostname = host
        if user is not None:
            self.conn.user = user
        if password is not None:
            self.conn.password = password
        if desired_capabilities:
            self.conn.desired_capabilities = [symbol(c) for c in desired_capabilities]
        self.collector = Collector()
        self.conn.collect(self.collector)
        self.transport.bind(self.conn)
        self.events: list[str] = []
        self.socket_closed = False
        if open:
            self.conn.open()

    @property
    def local_port(self) -> int:
        return self.sock.getsockname()[1]

    # ------------------------------------------------------------------ I/O

    def pump(self, max_wait: float = 0.05) -> None:
        """One round: write pending output, read what arrived (waiting at most
        `max_wait`), run the transport's timers, drain the event collector."""
        t = self.transport
        now = time.monotonic()
        deadline = t.tick(now)
        if not self.socket_closed:
            pending = t.pending()
            if pending > 0:
                try:
                    n = self.sock.send(t.peek(pending))
                    t.pop(n)
                except BlockingIOError:
                    pass
                except OSError:
                    self._socket_gone()
        wait = max_wait if deadline <= 0 else max(0.0, min(max_wait, deadline - now))
        if not self.socket_closed:
            readable, _, _ = select.select([self.sock], [], [], wait)
            if readable:
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    self._socket_gone()
                elif data:
                    self._push(data)
        t.tick(time.monotonic())
        while True:
            ev = self.collector.peek()
            if ev is None:
                break
            self.events.append(str(ev.type))
            self.collector.pop()

    def _push(self, data: bytes) -> None:
        t = self.transport
        view = memoryview(data)
        while view:
            cap = t.capacity()
            if cap <= 0:
                return
            t.push(bytes(view[:cap]))
            view = view[cap:]

    def _socket_gone(self) -> None:
        self.socket_closed = True
        self.transport.close_tail()
        self.transport.close_head()

    def wait(self, predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; events: "
                                     f"{self.events[-20:]}")
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))

    def pump_for(self, seconds: float) -> None:
        """Keep the connection serviced (heartbeats included) for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.pump(min(0.05, deadline - time.monotonic()))

    # ------------------------------------------------------------------ conveniences

    def wait_open(self, timeout: float = 10.0) -> "RawClient":
        self.wait(lambda: self.conn.state & (REMOTE_ACTIVE | REMOTE_CLOSED), timeout, "remote open")
        return self

    def wait_closed(self, timeout: float = 10.0) -> None:
        self.wait(lambda: self.conn.state & REMOTE_CLOSED or self.socket_closed, timeout,
                  "connection close")

    def session(self, timeout: float = 10.0):
        ssn = self.conn.session()
        ssn.open()
        self.wait(lambda: ssn.state & (REMOTE_ACTIVE | REMOTE_CLOSED), timeout, "begin")
        return ssn

    def receiver(self, session, address: str, name: str, timeout: float = 10.0):
        rcv = session.receiver(name)
        rcv.source.address = address
        rcv.target.address = None
        rcv.open()
        self.wait(lambda: rcv.state & (REMOTE_ACTIVE | REMOTE_CLOSED), timeout, f"attach of {name}")
        return rcv

    def sender(self, session, address: str, name: str, timeout: float = 10.0):
        snd = session.sender(name)
        snd.target.address = address
        snd.open()
        self.wait(lambda: snd.state & (REMOTE_ACTIVE | REMOTE_CLOSED), timeout, f"attach of {name}")
        return snd

    def close(self, timeout: float = 5.0) -> None:
        if not self.socket_closed:
            try:
                if self.conn.state & Endpoint.LOCAL_ACTIVE:
                    self.conn.close()
                self.wait(lambda: self.socket_closed or self.conn.state & REMOTE_CLOSED, timeout,
                          "close")
                self.pump(0)
            except AssertionError:
                pass
        self.abandon()

    def abandon(self) -> None:
        """Drop the socket without any AMQP close."""
        try:
            self.sock.close()
        except OSError:
            pass
        self.socket_closed = True


def remote_properties(conn: Connection) -> dict[str, Any]:
    return {str(k): v for k, v in (conn.remote_properties or {}).items()}


def remote_offered(conn: Connection) -> set[str]:
    caps = conn.remote_offered_capabilities
    if caps is None:
        return set()
    if hasattr(caps, "elements"):
        caps = caps.elements
    if isinstance(caps, (str, bytes)):
        caps = [caps]
    return {str(c) for c in caps}


def condition_info(cond: Any) -> dict[str, str]:
    info = cond.info if cond is not None else None
    return {str(k): str(v) for k, v in (info or {}).items()}


# ---------------------------------------------------------------------- raw frames

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"


def amqp_frame(channel: int, code: int, fields: list, frame_type: int = 0) -> bytes:
    """One frame carrying the performative `code` (frame_type 1: a SASL frame)."""
    data = Data()
    data.put_object(Described(ulong(code), fields))
    body = data.encode()
    return struct.pack(">IBBH", 8 + len(body), 2, frame_type, channel) + body


def read_frames(sock: socket.socket, timeout: float = 10.0, until: int = 0x18) -> list:
    """Performatives the peer sends (protocol headers skipped) until one with
    descriptor `until` (default: close) arrives, the socket closes, or timeout."""
    buf, out = b"", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        while True:
            if buf.startswith(b"AMQP") and len(buf) >= 8:
                buf = buf[8:]
                continue
            if len(buf) < 8:
                break
            size, doff = struct.unpack(">IB", buf[:5])
            if len(buf) < size:
                break
            body, buf = buf[doff * 4:size], buf[size:]
            if body:
                d = Data()
                d.decode(body)
                d.rewind()
                d.next()
                out.append(d.get_object())
        if any(getattr(p, "descriptor", None) == until for p in out):
            break
    return out


# ---------------------------------------------------------------------- CLI

CLI = [sys.executable, "-m", "amqpbroker.cli"]


def run_cli(args: list[str], *, env: dict | None = None, timeout: float = 30.0,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    import os
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


# ---------------------------------------------------------------------- TLS

def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1, made with the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60)
    return cert, key


__all__ = ["RawClient", "remote_properties", "remote_offered", "condition_info", "run_cli",
           "make_self_signed", "SASL", "amqp_frame", "read_frames", "AMQP_HEADER", "SASL_HEADER"]
