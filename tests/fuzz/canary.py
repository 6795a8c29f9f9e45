"""The canary: a well-behaved client doing round trips while the fuzzer runs.

One connection, one session, a sender and a receiver on the same queue.  A round
trip is the time from sending a small message until both its `accepted` came back
to the sender and the message itself arrived at the receiver.  Its own thread, so
that a broker which stalls on some mutant shows up here as a slow round trip.

A slow round trip has one of three causes, and `Sampler` tells them apart from
the kernel's accounting of the broker's event-loop thread (/proc/<pid>/task/<pid>/
schedstat: time on a CPU, time waiting for one) and of this process's own
scheduling (how late a 5 ms sleep wakes up):

* the broker was busy (on a CPU most of the time): its fault, to pin on a mutant;
* the broker, or this test process, was waiting for a CPU: the machine was busy
  (two cores, other test runs): counted and reported, not the broker's fault;
* neither: the broker was idle while its client waited: its fault too.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from proton import Delivery

from tests.e2e.helpers_conn import RawClient

PAUSE = 0.02      # between round trips: about 40 a second, light on the broker


class Canary(threading.Thread):
    def __init__(self, port: int, address: str = "fuzz.canary", broker_pid: int | None = None):
        super().__init__(name="fuzz-canary", daemon=True)
        self.port = port
        self.address = address
        self.samples: list[tuple[float, float]] = []     # (started, seconds)
        self.failures: list[str] = []
        self.sampler = Sampler(broker_pid) if broker_pid else None
        self._halt = threading.Event()
        self._ready = threading.Event()

    def start_and_wait(self) -> Canary:
        if self.sampler is not None:
            self.sampler.start()
        self.start()
        if not self._ready.wait(10):
            raise AssertionError(f"canary did not connect: {self.failures}")
        return self

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        if self.sampler is not None:
            self.sampler.stop()

    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.failures.append(f"canary crashed: {exc!r}")
            self._ready.set()

    def _loop(self) -> None:
        client = RawClient("127.0.0.1", self.port, container_id="fuzz-canary").wait_open()
        ssn = client.session()
        rcv = client.receiver(ssn, self.address, "canary-rcv")
        snd = client.sender(ssn, self.address, "canary-snd")
        rcv.flow(1000)
        self._ready.set()
        n = 0
        while not self._halt.is_set():
            n += 1
            body = f"canary-{n}".encode()
            raw = b"\x00\x53\x75\xa0" + bytes((len(body),)) + body        # one data section
            started = time.monotonic()
            dlv = snd.delivery(body)
            snd.send(raw)
            snd.advance()
            if not self._round_trip(client, rcv, dlv, raw):
                self.samples.append((started, time.monotonic() - started))   # the last, unfinished
                return
            self.samples.append((started, time.monotonic() - started))
            if rcv.credit < 500:
                rcv.flow(1000 - rcv.credit)
            time.sleep(PAUSE)
        client.close()

    def _round_trip(self, client, rcv, dlv, raw) -> bool:
        """Pump until the message is back and accepted; False if the connection
        went or the canary was stopped first (a broker that stopped answering)."""
        arrived = False
        while True:
            if client.socket_closed or client.conn.state & client.conn.REMOTE_CLOSED:
                self.failures.append("canary connection closed by the broker")
                return False
            incoming = rcv.current
            while incoming is not None and not incoming.partial:
                payload = bytes(rcv.recv(incoming.pending) or b"")
                rcv.advance()
                incoming.update(Delivery.ACCEPTED)
                incoming.settle()
                if payload == raw:
                    arrived = True
                else:
                    self.failures.append(f"canary got a message it did not send: {payload[:40]!r}")
                incoming = rcv.current
            if arrived and dlv.remote_state:
                if dlv.remote_state != Delivery.ACCEPTED:
                    self.failures.append(f"canary message not accepted: {dlv.remote_state}")
                dlv.settle()
                return True
            if self._halt.is_set():
                self.failures.append("canary round trip unfinished when the run ended")
                return False
            client.pump(0.005)

    # ------------------------------------------------------------------ figures

    def seconds(self) -> list[float]:
        return sorted(s for _, s in self.samples)

    def percentile(self, p: float) -> float:
        s = self.seconds()
        return s[min(len(s) - 1, int(p * len(s)))] if s else 0.0

    def slow(self, bound: float) -> list[tuple[float, float]]:
        return [(t, s) for t, s in self.samples if s > bound]


@dataclass
class Why:
    broker_cpu: float      # share of the window the broker's loop thread spent on a CPU
    broker_wait: float     # share it spent runnable, waiting for a CPU
    client_stall: float    # share of the window this process's sampler was late by (at most)

    @property
    def machine(self) -> bool:
        """The machine, not the broker: one of the two was kept off the CPUs."""
        return self.broker_cpu < 0.5 and (self.broker_wait >= 0.3 or self.client_stall >= 0.5)

    def __str__(self) -> str:
        return (f"broker on CPU {self.broker_cpu:.0%}, waiting for a CPU {self.broker_wait:.0%}, "
                f"test process late {self.client_stall:.0%}")


class Sampler(threading.Thread):
    """Every 5 ms: the broker loop thread's CPU and run-queue time, and how late
    this thread woke up."""

    TICK = 0.005

    def __init__(self, pid: int):
        super().__init__(name="fuzz-sampler", daemon=True)
        self.path = f"/proc/{pid}/task/{pid}/schedstat"
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.wait: list[float] = []
        self.late: list[float] = []
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        expected = time.monotonic()
        while not self._halt.is_set():
            now = time.monotonic()
            try:
                with open(self.path) as f:
                    on_cpu, waiting, _ = f.read().split()
            except (OSError, ValueError):
                return          # the broker is gone
            self.times.append(now)
            self.cpu.append(int(on_cpu) / 1e9)
            self.wait.append(int(waiting) / 1e9)
            self.late.append(max(0.0, now - expected))
            expected = now + self.TICK
            time.sleep(self.TICK)

    def why(self, start: float, end: float) -> Why | None:
        i, j = bisect_left(self.times, start), bisect_right(self.times, end) - 1
        if j <= i:
            return None
        span = max(self.times[j] - self.times[i], 1e-9)
        late = max(self.late[i:j + 1], default=0.0)
        return Why((self.cpu[j] - self.cpu[i]) / span, (self.wait[j] - self.wait[i]) / span,
                   min(1.0, late / max(end - start, 1e-9)))


__all__ = ["Canary", "Sampler", "Why"]
