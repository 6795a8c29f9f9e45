"""The wire fuzzer (see tests/fuzz/__init__.py for the corpus, the mutators, the
outcomes and how to run a deep fuzz locally).

One broker for the run.  A canary client does round trips throughout, and a control
canary of another, idle broker over the same seconds (tests/e2e/canary.py).  Frame
mutants get a connection each (PARALLEL at a time); message mutants share one
(batches of MESSAGE_BATCH, each drained by a selecting consumer and a plain one).
The run fails on: the broker dying or refusing connections; the canary slowed beyond
what the machine did to the control canary (CanaryReport.unlike: more slow round
trips than the control's allow, or a very long one), leaving out the slow round trips
a known finding or the broker's garbage collector (gcprobe/) explains, which are
reported; a traceback or "internal-error" in the broker's log; a connection left
hanging (no close and no answer to the probe within 1 s); a message with no outcome
within 1 s, delivered altered, or delivered against its selector — except findings
already reported (tests/fuzz/known.py, each with an xfail regression test).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections import Counter, defaultdict

import pytest

from tests.e2e.canary import Canary

from . import corpus, known, messages, mutators, wire

pytestmark = [pytest.mark.e2e, pytest.mark.fuzz]

CASES = 5000                # frame mutants in a CI run (each its own connection)
MESSAGE_CASES = 3000        # message mutants in a CI run (many to one connection)
MESSAGE_BATCH = 1000        # message mutants per queue (drained after each batch)
SEED = 20241124
PARALLEL = 4                # frame mutants in flight at once
CANARY_PAUSE = 0.02         # seconds between canary round trips: light on the brokers
# A canary round trip is slow from 250 ms (or 3 x the control's p99): the fuzzed broker's
# loop serves PARALLEL hostile connections besides the canary, which the idle control's
# does not (its round trips reach 100-200 ms now and then on a busy machine).
CANARY_FLOOR = 0.25

# AMQPBROKER_FUZZ_CASES=N: N frame mutants (and messages in proportion) for a deep
# run; AMQPBROKER_FUZZ_SEED: other mutants; AMQPBROKER_FUZZ_AVOID=0: send the
# mutants of known bugs that stop the broker too (known.AVOID).
FRAME_COUNT = int(os.environ.get("AMQPBROKER_FUZZ_CASES", CASES))
MESSAGE_COUNT = max(1, FRAME_COUNT * MESSAGE_CASES // CASES)
RUN_SEED = int(os.environ.get("AMQPBROKER_FUZZ_SEED", SEED))
AVOID = os.environ.get("AMQPBROKER_FUZZ_AVOID", "1") != "0"
TIME_LIMIT = max(120, FRAME_COUNT // 20)     # pytest-timeout: a deep run takes longer


# --------------------------------------------------------------------------- the corpus itself


def test_the_corpus_replays_cleanly(fuzz_broker):
    """Unmutated, each captured conversation is answered in full: every attach
    answered, transfers settled, the probe answered; with its close, the broker
    closes without an error.  (Else the mutants would start from nonsense.)"""
    before = len(fuzz_broker.lines)
    for n, conv in enumerate(corpus.build()):
        open_case = wire.case_from(900_000 + n, mutators.Mutant("none", conv.without_close().frames, conv.name))
        closed_case = wire.case_from(900_100 + n, mutators.Mutant("none", conv.frames, conv.name))
        wire.run_cases(fuzz_broker.port, [open_case, closed_case], parallel=1, on_done=lambda c: None)
        assert open_case.outcome == "usable", (conv.name, open_case.outcome)
        assert closed_case.outcome == "closed:no-condition", (conv.name, closed_case.outcome)
        sent = Counter(f.code for f in conv.frames if f.kind == "amqp")
        got = open_case.replies.performatives
        assert got[corpus.ATTACH] == sent[corpus.ATTACH], (conv.name, got)
        assert got[corpus.BEGIN] == sent[corpus.BEGIN] + 1, (conv.name, got)          # + the probe's
        if sent[corpus.TRANSFER]:
            assert got[corpus.DISPOSITION] or got[corpus.FLOW], (conv.name, got)
    assert not known.traceback_blocks(fuzz_broker.lines[before:])


# --------------------------------------------------------------------------- what the run saw


class Findings:
    """Everything the run saw, and what of it fails the run."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.known: Counter[str] = Counter()
        self.avoided: Counter[str] = Counter()
        self.slow: list[str] = []               # slow canary round trips nothing known explains
        self.gc_slow: list[str] = []            # ... that the broker's garbage collector made slow
        self.gc_pauses: list[tuple[float, float]] = []    # (start, seconds), monotonic clock
        self.known_slow: set[float] = set()     # canary round trips (by start) a known finding made slow
        self.frame_outcomes: dict[str, Counter] = defaultdict(Counter)
        self.message_outcomes: dict[str, Counter] = defaultdict(Counter)
        self.done: list[wire.Case] = []
        self.kept: list[wire.Case] = []         # cases with their bytes, for the report
        self.batches: list[tuple[messages.MessageRun, list[bytes], list[bytes]]] = []
        self.phases: list[tuple[float, float, str]] = []     # what else ran when
        self.elapsed: Counter[str] = Counter()

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def frame_case(self, case: wire.Case) -> None:
        self.done.append(case)
        self.frame_outcomes[case.kind][case.outcome] += 1
        if case.outcome == "usable" or (case.outcome.startswith("closed:")
                                        and case.outcome != "closed:amqp:internal-error"):
            case.received, case.replies = b"", None     # what it sent stays (for known_slow)
        else:
            self.kept.append(case)

    def message_cases(self) -> list[messages.MessageCase]:
        return [c for run, _, _ in self.batches for c in run.cases]

    def before(self, case: wire.Case, n: int) -> list[wire.Case]:
        """The n cases that started before `case` (what may have stopped the broker)."""
        return [c for c in self.done if c.started < case.started][-n:]

    def meanwhile(self, start: float, end: float) -> tuple[list[str], list[object]]:
        """What ran between start and end: labels, and the cases among them."""
        spans = [(c.started, c.finished, f"frame case {c.number} {c.kind}: {c.note}", c) for c in self.done]
        spans += [(c.started, c.started + c.seconds, f"message {c.number} {c.kind}: {c.note}", c)
                  for c in self.message_cases()]
        spans += [(s, e, label, None) for s, e, label in self.phases]
        hits = [(label, obj) for s, e, label, obj in spans if s <= end and e >= start]
        return [label for label, _ in hits], [obj for _, obj in hits if obj is not None]


def _explained(blocks: list[str], port: int) -> bool:
    """An internal-error on the connection from `port` that a known traceback
    explains (the engine logs "connection 127.0.0.1:<port>: error handling event")."""
    mine = [b for b in blocks if f"127.0.0.1:{port}: error handling event" in b]
    return bool(mine) and all(known.known_traceback(b) for b in mine)


def _check_frames(findings: Findings, lines: list[str], blocks: list[str]) -> None:
    refused = [c for c in findings.kept if c.outcome.startswith("connect-failed")]
    if refused:
        findings.problem(f"the broker did not accept {len(refused)} connections ({refused[0].outcome}); "
                         "cases before the first: "
                         + "; ".join(f"{c.number} {c.kind}: {c.note}" for c in findings.before(refused[0], 12)))
    for case in findings.done:
        if case.undecodable:
            findings.problem(f"the broker sent {case.undecodable} frames that do not decode: case {case.number} "
                             f"{case.kind}: {case.note}")
    for case in findings.kept:
        if case.outcome == "hung":
            k = known.known_hang(case)
            if k:
                findings.known[k.name] += 1
            else:
                findings.problem(f"connection left hanging: case {case.number} {case.kind}: {case.note}\n"
                                 f"  framing={case.framing} bytes={case.payload[:600].hex()}")
        elif case.outcome == "closed:amqp:internal-error" and not _explained(blocks, case.local_port):
            findings.problem(f"internal-error without a known cause: case {case.number} {case.kind}: "
                             f"{case.note}\n  bytes={case.payload[:600].hex()}\n"
                             + "".join(lines[case.log_from:case.log_to + 1])[-3000:])


def _check_log(findings: Findings, lines: list[str], blocks: list[str]) -> None:
    for block in blocks:
        k = known.known_traceback(block)
        if k:
            findings.known[k.name] += 1
        else:
            findings.problem("unknown traceback in the broker log:\n" + block[:1500] + "\n...\n" + block[-1500:])
    for line in lines:
        if "internal-error" in line:
            findings.problem(f"internal-error in the broker log: {line.strip()}")


GC_PROBE = re.compile(r"fuzz-gc-probe: generation (\d) at ([\d.]+) took ([\d.]+)")


def _gc_pauses(lines: list[str], wall_minus_monotonic: float) -> list[tuple[float, float]]:
    """The broker's collector pauses (tests/fuzz/gcprobe), on this process's monotonic clock."""
    found = (GC_PROBE.search(line) for line in lines if "fuzz-gc-probe" in line)
    return [(float(m.group(2)) - wall_minus_monotonic, float(m.group(3))) for m in found if m]


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, s + d) - max(start, s)) for s, d in spans)


def _check_canary(findings: Findings, canary: Canary, control: Canary, failures: list[str],
                  wall_minus_monotonic: float) -> None:
    """The canary against the control canary (CanaryReport.unlike), leaving out the slow
    round trips a known finding or a collector pause explains.  Round trips start on
    the wall clock (the canary is another process); the run's spans on this one's
    monotonic clock."""
    for failure in failures:
        findings.problem(f"canary: {failure}")
    report, other = canary.report, control.report
    if report is None or other is None:
        return
    if len(report.samples) < 10:
        findings.problem(f"canary made only {len(report.samples)} round trips")
    bound = other.slow_bound(CANARY_FLOOR)
    excused: set[float] = set()
    for started, seconds in report.samples:
        if seconds <= bound:
            continue
        start = started - wall_minus_monotonic
        meanwhile, cases = findings.meanwhile(start, start + seconds)
        k = known.known_slow(meanwhile, cases)
        if k:
            findings.known[k.name] += 1
            findings.known_slow.add(started)
            excused.add(started)
            continue
        gc_time = _overlap(findings.gc_pauses, start, start + seconds)
        what = (f"canary round trip {seconds * 1000:.0f} ms > {bound * 1000:.0f} ms (the broker's garbage "
                f"collector {gc_time * 1000:.0f} ms of it)")
        if gc_time and seconds - gc_time <= bound:
            findings.gc_slow.append(what)
            excused.add(started)
            continue
        findings.slow.append(f"{what}; meanwhile: " + "; ".join(meanwhile[:12]))
    problem = report.unlike(other, CANARY_FLOOR, excused=excused)
    if problem is not None:
        findings.problem(f"canary: {problem}\n" + "\n".join(findings.slow[:10]))


def _check_messages(findings: Findings, blocks: list[str]) -> None:
    for run, selected, everything in findings.batches:
        accepted = Counter(c.raw for c in run.cases if c.outcome == "accepted")
        for case in run.cases:
            findings.message_outcomes[case.kind][case.outcome] += 1
            if case.outcome == "hung":
                findings.problem(f"message without an outcome within 1 s: {case.kind}: {case.note}: "
                                 f"{case.raw[:300].hex()}")
            elif case.outcome == "rejected:no-condition":
                findings.problem(f"message rejected without a condition: {case.kind}: {case.raw[:300].hex()}")
            elif case.outcome.startswith(("connection-closed", "state:")) and not _explained(blocks, case.local_port):
                findings.problem(f"message {case.kind} ({case.note}) -> {case.outcome}: {case.raw[:300].hex()}")
        extra = Counter(selected) + Counter(everything) - accepted
        if extra:
            findings.problem(f"{sum(extra.values())} delivered messages were never accepted as sent (altered "
                             f"or duplicated): {[m[:60].hex() for m in list(extra)[:5]]}")
        for raw in selected:
            if messages.expected_match(raw) is False:
                findings.problem(f"the selecting consumer got a message its selector refuses: {raw[:200].hex()}")
        for raw in accepted:
            expected = messages.expected_match(raw)
            if expected is True and raw not in selected:
                findings.problem(f"a message the selector accepts did not reach the selecting consumer: "
                                 f"{raw[:200].hex()}")
            if expected is False and raw not in everything:
                findings.problem(f"a message was accepted but never delivered: {raw[:200].hex()}")


# --------------------------------------------------------------------------- the report


def _table(outcomes: dict[str, Counter]) -> str:
    rows = []
    for kind in sorted(outcomes):
        row = ", ".join(f"{o} {n}" for o, n in outcomes[kind].most_common())
        rows.append(f"  {kind:24} {sum(outcomes[kind].values()):5}: {row}")
    return "\n".join(rows)


def _report(findings: Findings, canary: Canary, control: Canary) -> str:
    total: Counter[str] = Counter()
    for c in findings.frame_outcomes.values():
        total.update(c)
    no_condition = {k: c["closed:no-condition"] + c["dropped"] for k, c in findings.frame_outcomes.items()
                    if c["closed:no-condition"] + c["dropped"]}
    report, other = canary.report, control.report
    others = [s for t, s in report.samples if t not in findings.known_slow] if report else []
    runs = [run for run, _, _ in findings.batches]
    e = findings.elapsed
    return "\n".join([
        (f"wire fuzz, seed {RUN_SEED}: {sum(total.values())} frame mutants in {e['frames']:.1f} s, "
         f"{len(findings.message_cases())} message mutants in {e['messages']:.1f} s "
         f"({sum(r.reconnects for r in runs)} reconnects), drains {e['drain']:.1f} s"),
        "frame outcomes by mutator:", _table(findings.frame_outcomes),
        "all frame outcomes: " + ", ".join(f"{o} {n}" for o, n in total.most_common()),
        "closed without a condition (a close frame without one, or dropped) by mutator: "
        + ", ".join(f"{k} {n}" for k, n in sorted(no_condition.items())),
        "message outcomes by mutator:", _table(findings.message_outcomes),
        (f"canary: {report.summary() if report else 'no report'}; control canary (an idle broker): "
         f"{other.summary() if other else 'no report'}; "
         f"max without the known findings' {len(findings.known_slow)} {max(others, default=0) * 1000:.1f} ms; "
         f"slow (over {other.slow_bound(CANARY_FLOOR) * 1000 if other else 0:.0f} ms) with nothing known meanwhile: "
         f"{len(findings.slow)}, because of a collector pause: {len(findings.gc_slow)}"
         + "".join(f"\n  {m}" for m in (findings.slow + findings.gc_slow)[:5])),
        (f"broker garbage-collector pauses over 10 ms: {len(findings.gc_pauses)}, longest "
         f"{max((d for _, d in findings.gc_pauses), default=0) * 1000:.0f} ms"),
        "known findings (tests/fuzz/test_regressions.py): "
        + (", ".join(f"{k}: {n}" for k, n in findings.known.most_common()) or "none"),
        "mutants left out (known bugs that stop the broker): "
        + (", ".join(f"{k}: {n}" for k, n in findings.avoided.most_common()) or "none"),
    ])


# --------------------------------------------------------------------------- the run


def _frame_phase(broker, findings: Findings, convs, answered) -> None:
    def sendable(mutants):
        """Numbered cases (a case's number is its mutant's place in the sequence),
        without the mutants of known bugs that would stop the whole broker."""
        for n, m in enumerate(mutants):
            a = known.avoided(m.frames) if AVOID else None
            if a:
                findings.avoided[a.name] += 1
            else:
                yield wire.case_from(n, m, answered)

    def stop() -> bool:
        return broker.proc.poll() is not None or any(
            c.outcome.startswith("connect-failed") for c in findings.done[-PARALLEL:])

    started = time.monotonic()
    wire.run_cases(broker.port, sendable(mutators.mutants(convs, FRAME_COUNT, RUN_SEED)), parallel=PARALLEL,
                   on_done=findings.frame_case, log_position=lambda: len(broker.lines), stop=stop)
    findings.elapsed["frames"] += time.monotonic() - started


def _message_phase(broker, findings: Findings) -> None:
    dead = lambda: broker.proc.poll() is not None
    cases = messages.message_mutants(MESSAGE_COUNT, RUN_SEED)
    for batch in itertools.count():
        queue = f"fuzz.msg.{RUN_SEED}.{batch}"
        started = time.monotonic()
        run = messages.run_messages(broker.port, itertools.islice(cases, MESSAGE_BATCH), queue,
                                    lambda: len(broker.lines), dead)
        findings.elapsed["messages"] += time.monotonic() - started
        if not run.cases or dead():
            return
        # Drained while the canary runs: what each consumer must get is what the
        # broker's pure core says (messages.expected_match).
        expect = defaultdict(list)
        for case in run.cases:
            if case.outcome == "accepted":
                expect[messages.expected_match(case.raw)].append(case.raw)
        started = time.monotonic()
        selected = messages.drain(broker.port, queue, messages.SELECTOR, expect=expect[True])
        middle = time.monotonic()
        everything = messages.drain(broker.port, queue, None, expect=expect[False])
        findings.phases += [(started, middle, f"the selecting consumer draining {queue}"),
                            (middle, time.monotonic(), f"the plain consumer draining {queue}")]
        findings.elapsed["drain"] += time.monotonic() - started
        findings.batches.append((run, selected, everything))


def _stop(canary: Canary, failures: list[str]) -> None:
    """End a canary; a failure of its client (the broker closed its connection, a
    receive that waited 30 s) is the run's finding, not an error of the test."""
    try:
        canary.__exit__(None, None, None)
    except RuntimeError as exc:
        failures.append(str(exc))


@pytest.mark.timeout(TIME_LIMIT)
def test_wire_fuzz(fuzz_broker, fuzz_control):
    broker = fuzz_broker
    findings = Findings()
    wall_minus_monotonic = time.time() - time.monotonic()
    before = len(broker.lines)
    convs = corpus.build()
    answered = wire.calibrate(broker.port, convs)        # the turns the broker answers, to pace by
    failures: list[str] = []
    control = Canary(fuzz_control, pause=CANARY_PAUSE).__enter__()
    try:
        canary = Canary(broker, pause=CANARY_PAUSE).__enter__()
    except BaseException:
        _stop(control, [])
        raise
    try:
        _frame_phase(broker, findings, convs, answered)
        _message_phase(broker, findings)
    finally:
        _stop(canary, failures)
        _stop(control, [])
        time.sleep(0.2)     # the last log lines

    lines = broker.lines[before:]
    if broker.proc.poll() is not None:
        findings.problem(f"the broker died (exit {broker.proc.returncode}); last cases: "
                         + "; ".join(f"{c.number} {c.kind}: {c.note}" for c in findings.done[-PARALLEL:])
                         + "\n" + "".join(lines[-30:]))
    blocks = known.traceback_blocks(lines)
    findings.gc_pauses = _gc_pauses(lines, wall_minus_monotonic)
    _check_frames(findings, broker.lines, blocks)
    _check_log(findings, lines, blocks)
    _check_canary(findings, canary, control, failures, wall_minus_monotonic)
    _check_messages(findings, blocks)
    if len(findings.done) + sum(findings.avoided.values()) < FRAME_COUNT and not findings.problems:
        findings.problem(f"only {len(findings.done)} of {FRAME_COUNT} frame mutants ran")

    report = _report(findings, canary, control)
    print("\n" + report)
    assert not findings.problems, report + "\n\nPROBLEMS:\n" + "\n\n".join(findings.problems[:30])
