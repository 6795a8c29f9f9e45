"""A canary: a well-behaved client doing round trips on its own connection, in a
child process, while a test makes the broker do something heavy or hostile.  Every
other client shares the broker's one event loop, so the canary's round-trip times are
what they would see.  A process, not a thread: the test's own work (a client draining
at full speed, a scraper) must not show up as broker latency through the GIL.

    with Canary(broker) as canary:
        attack()
    canary.assert_served(max_rtt=0.1)      # or canary.report.worst, .quantile(0.99)

On a busy machine an absolute bound fails by chance (a 112 ms round trip against
100 ms).  Compare instead with a control canary of another, idle broker over the
same seconds, which meets the same machine load but not the attack:

    with Canary(idle_broker) as control, Canary(broker) as canary:
        attack()
    canary.assert_like(control)
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

def _canary_main(url: str, address: str, ready: Any, stop: Any, out: Any) -> None:
    """Child process: round trips until `stop` is set; sends back (start, rtt) pairs."""
    from proton import Message

    from tests.client import connect

    conn = connect(url, container_id=f"canary-{uuid.uuid4().hex[:8]}")
    try:
        snd = conn.create_sender(address, name="canary-snd")
        rcv = conn.create_receiver(address, name="canary-rcv", credit=1)
        for _ in range(20):                                  # warm up (connection, links)
            snd.send(Message(body="warm-up", durable=False))
            rcv.receive(timeout=10)
            rcv.accept()
        ready.set()
        samples: list[tuple[float, float]] = []
        n = 0
        while not stop.is_set():
            started = time.time()
            t0 = time.perf_counter()
            snd.send(Message(body=n, durable=False))        # waits for the broker's accept
            msg = rcv.receive(timeout=30)                   # the delivery back
            rcv.accept()
            rtt = time.perf_counter() - t0
            if msg.body != n:
                raise RuntimeError(f"canary got {msg.body!r}, expected {n}")
            samples.append((started, rtt))
            n += 1
        out.send(samples)
    except BaseException as exc:  # noqa: BLE001 — reported to the parent, which fails
        out.send(f"canary failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        conn.close()


@dataclass
class CanaryReport:
    samples: list[tuple[float, float]]          # (wall-clock start, round-trip seconds)

    @property
    def rtts(self) -> list[float]:
        return [r for _, r in self.samples]

    def quantile(self, q: float) -> float:
        rtts = sorted(self.rtts)
        return rtts[min(len(rtts) - 1, int(q * len(rtts)))]

    @property
    def worst(self) -> float:
        return max(self.rtts)

    def summary(self) -> str:
        ms = lambda s: f"{s * 1000:.1f} ms"   # noqa: E731
        return (f"{len(self.samples)} round trips: p50 {ms(statistics.median(self.rtts))}, "
                f"p99 {ms(self.quantile(0.99))}, max {ms(self.worst)}")


class Canary:
    """`with Canary(broker_or_url) as c: ...`; then `c.report` / `c.assert_served()`."""

    def __init__(self, target: Any, address: str | None = None):
        url = target if isinstance(target, str) else target.url
        ctx = multiprocessing.get_context("spawn")
        self.address = address or f"canary-{uuid.uuid4().hex[:8]}"
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._parent, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_canary_main, args=(url, self.address, self._ready, self._stop, child),
                                 daemon=True)
        self._child = child
        self.report: CanaryReport | None = None

    def __enter__(self) -> "Canary":
        self._proc.start()
        if not self._ready.wait(60):
            self._proc.kill()
            raise RuntimeError("the canary client did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        try:
            if not self._parent.poll(60):
                raise RuntimeError("the canary client did not report")
            result = self._parent.recv()
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        if isinstance(result, str):
            raise RuntimeError(result)
        if not result:
            raise RuntimeError("the canary made no round trip")
        self.report = CanaryReport(result)

    def assert_like(self, control: "Canary", min_round_trips: int = 5, floor: float = 0.1) -> None:
        """The attack did not slow this canary down beyond what the machine did to
        `control`: a canary of another, idle broker, run over the same seconds (same
        machine, same load, no attack).  A round trip is slow above `floor` or 3 ×
        the control's p99, whichever is more; this canary may have twice as many slow
        ones as the control, plus one (scheduling spikes on a busy machine hit both
        alike, not the same round trips), and none beyond max(0.5 s, 5 × the control's
        worst).  A broker loop held for a throttle's wait, or slowed by every byte of a
        flood, shows as several slow round trips or one very long one here only."""
        mine, other = self.report, control.report
        assert mine is not None and other is not None, "use both canaries in `with`"
        assert len(mine.samples) >= min_round_trips and len(other.samples) >= min_round_trips, \
            "too few round trips"
        slow = max(floor, 3 * other.quantile(0.99))
        slow_here = [round(t, 3) for t in mine.rtts if t > slow]
        allowed = 2 * sum(1 for t in other.rtts if t > slow) + 1
        ceiling = max(0.5, 5 * other.worst)
        detail = f"control: {other.summary()}; this: {mine.summary()}"
        assert len(slow_here) <= allowed, \
            f"{len(slow_here)} round trips over {slow * 1000:.0f} ms {slow_here}, {allowed} allowed ({detail})"
        assert mine.worst <= ceiling, f"a round trip of {mine.worst * 1000:.0f} ms ({detail})"

    def assert_served(self, max_rtt: float = 0.1, min_round_trips: int = 5) -> None:
        """Every round trip completed (the child reports failures at exit), none slower
        than `max_rtt` seconds."""
        report = self.report
        assert report is not None and len(report.samples) >= min_round_trips, "too few round trips"
        assert report.worst <= max_rtt, f"canary too slow: {report.summary()}"


__all__ = ["Canary", "CanaryReport"]
