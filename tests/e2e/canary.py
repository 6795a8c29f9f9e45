"""A canary: a well-behaved client doing round trips on its own connection, in a
child process, while a test makes the broker do something heavy or hostile.  Every
other client shares the broker's one event loop, so the canary's round-trip times are
what they would see.  A process, not a thread: the test's own work (a client draining
at full speed, a scraper, a fuzzer) must not show up as broker latency through the GIL.

CI runs on a busy two-core machine, where an absolute bound fails by chance (a 112 ms
round trip against 100 ms, on unchanged code).  So a canary is compared with a
control canary of another, idle broker over the same seconds, which meets the same
machine load but not the attack:

    with Canary(idle_broker) as control, Canary(broker) as canary:
        attack()
    canary.assert_like(control)

(`control_broker`, tests/conftest.py, is such an idle broker.)  A test that must
pass over some slow round trips (the fuzzer: what a known finding or the broker's
garbage collector explains) compares the reports itself: `CanaryReport.unlike`.
`assert_served` only asks that the canary was served at all.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

def _canary_main(url: str, address: str, pause: float, ready: Any, stop: Any, out: Any) -> None:
    """Child process: round trips until `stop` is set, `pause` seconds apart; sends back
    (start, rtt) pairs."""
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
            if pause:
                stop.wait(pause)
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

    def slow_bound(self, floor: float = 0.1) -> float:
        """Of this report as a control: a round trip above it is slow (`floor`, or 3 x
        the control's p99, whichever is more)."""
        return max(floor, 3 * self.quantile(0.99))

    def unlike(self, control: "CanaryReport", floor: float = 0.1, min_round_trips: int = 5,
               excused: Container[float] = ()) -> str | None:
        """Why this canary was slowed beyond what the machine did to `control` (a canary
        of another, idle broker over the same seconds: same machine, same load, no
        attack), or None.  A round trip is slow above `control.slow_bound(floor)`; this
        canary may have twice as many slow ones as the control, plus one (scheduling
        spikes on a busy machine hit both alike, not the same round trips), and none
        beyond max(0.5 s, 5 x the control's worst).  A broker loop held for a
        throttle's wait, or slowed by every byte of a flood, shows as several slow
        round trips or one very long one here only.  `excused`: the start times of
        round trips left out (the caller knows why they were slow)."""
        if len(self.samples) < min_round_trips or len(control.samples) < min_round_trips:
            return f"too few round trips (this: {len(self.samples)}, control: {len(control.samples)})"
        slow = control.slow_bound(floor)
        counted = [r for t, r in self.samples if t not in excused]
        slow_here = [round(r, 3) for r in counted if r > slow]
        allowed = 2 * sum(1 for r in control.rtts if r > slow) + 1
        ceiling = max(0.5, 5 * control.worst)
        detail = f"control: {control.summary()}; this: {self.summary()}"
        if excused:
            detail += f"; {len(self.samples) - len(counted)} excused"
        if len(slow_here) > allowed:
            return (f"{len(slow_here)} round trips over {slow * 1000:.0f} ms {slow_here[:20]}, {allowed} allowed "
                    f"({detail})")
        worst = max(counted, default=0.0)
        if worst > ceiling:
            return f"a round trip of {worst * 1000:.0f} ms, {ceiling * 1000:.0f} ms allowed ({detail})"
        return None


class Canary:
    """`with Canary(broker_or_url) as c: ...`; then `c.report`, `c.assert_like(control)`.
    `pause`: seconds between round trips (0: back to back; a long run stays light on
    the broker with a few hundredths)."""

    def __init__(self, target: Any, address: str | None = None, pause: float = 0.0):
        url = target if isinstance(target, str) else target.url
        ctx = multiprocessing.get_context("spawn")
        self.address = address or f"canary-{uuid.uuid4().hex[:8]}"
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._parent, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_canary_main, args=(url, self.address, pause, self._ready, self._stop, child),
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
        `control` (CanaryReport.unlike)."""
        mine, other = self.report, control.report
        assert mine is not None and other is not None, "use both canaries in `with`"
        problem = mine.unlike(other, floor, min_round_trips)
        assert problem is None, problem

    def assert_served(self, min_round_trips: int = 5) -> None:
        """Round trips were made, and every one completed (the child reports a failure,
        such as a receive that waited 30 s, at exit).  No latency bound."""
        report = self.report
        assert report is not None and len(report.samples) >= min_round_trips, "too few round trips"


__all__ = ["Canary", "CanaryReport"]
