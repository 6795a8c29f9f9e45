"""The wire fuzzer: hostile bytes against the real broker, in the test suite.

Run it (one broker, a few thousand mutants, well under two minutes)::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/fuzz

A deep run locally (more mutants, other seeds; the store on, which finds the
known SIGSEGV until it is fixed)::

    AMQPBROKER_FUZZ_CASES=50000 AMQPBROKER_FUZZ_SEED=7 AMQPBROKER_FUZZ_STORE=1 \\
        .venv/bin/python -m pytest -q -p no:cacheprovider -s tests/fuzz/test_wire_fuzz.py

`-s` prints the report: outcomes per mutator, the canaries' p50 / p99 / max, known findings.

Corpus (corpus.py)
    The exact bytes python-qpid-proton's client engine sends in typical
    conversations, captured in memory against a small proton server engine, split
    into headers and frames and into the client's *turns* (what it sends between
    two things the server said).  Built at test time, deterministically; nothing
    binary is stored.  Conversations: `basic` (SASL ANONYMOUS, open, begin, a
    sender and a receiver, transfers with every section shape, dispositions with
    every outcome, detach, end, close), `presettled` (pre-settled sends, a transfer
    over several frames, a drained receiver, detach without closing), `jms`
    (Qpid JMS's shape: capabilities, two sessions, a consumer with a jms-selector
    and no-local filter, a durable shared topic subscription, an anonymous-relay
    producer), `txn` (coordinator link, declare with ulong and symbolic
    descriptors, transactional transfer and acceptance, discharge commit and
    rollback).

Mutators (mutators.py, messages.py)
    Frame mutants (one connection each): bit flips, byte insert / delete,
    truncation, frame sizes that lie upwards and downwards, random channels, a
    field (or a value nested in one) replaced by a random AMQP value of another
    type, random performatives 0x10-0x18 with random field lists, nesting 10..5000
    deep (lists, maps, described values, arrays) in fields and message sections,
    counts and sizes the bytes cannot hold, and reordered conversations (begin
    twice, attach with a used handle, transfer before attach, flow / detach for
    unknown handles, disposition ranges, end twice, frames after end, frames
    duplicated, swapped, dropped).  Message mutants (many to one connection):
    hostile transfer payloads in well-formed transfers.

Outcomes (wire.py)
    A frame mutant is sent turn by turn (pacing as the unmutated conversation
    was answered), a frame it leaves incomplete is padded to its declared size,
    then a probe (`begin` on a fresh channel) goes.  Within 1 s the broker must
    close (`closed:<condition>`, `closed:no-condition`, `dropped`: no close frame,
    `sasl:<code>`) or answer the probe (`usable`); else `hung`.  A message mutant
    must be accepted or rejected within 1 s; what was accepted is drained by a
    selecting consumer and a plain one and must come back byte for byte, each
    where the selector (judged by the broker's own pure core) puts it.

Throughout, a canary client does round trips (tests/e2e/canary.py), and so does a
control canary on another, idle broker with the same settings: the canary must be
served as well as the control over the same seconds (the machine's load hits both),
and the broker's log must stay free of tracebacks and "internal-error".  A slow round
trip is pinned on what ran meanwhile; gcprobe/ (a sitecustomize on the broker's
PYTHONPATH only) tells the broker's garbage-collector pauses apart: those are
reported, not failed.  Findings already reported are listed in known.py, each with an
xfail(strict) reproduction in test_regressions.py: they are counted, not failed,
until the fix flips the regression test.  Mutants of a known bug that would stop
the whole broker are left out (known.AVOID, counted; AMQPBROKER_FUZZ_AVOID=0 sends
them), and so is the store (AMQPBROKER_FUZZ_STORE=1), until their fixes.

Property tests of the codec, messages and selectors on arbitrary input are in
tests/core/test_codec_fuzz.py and tests/core/test_selectors_fuzz.py (strategies.py).
"""
