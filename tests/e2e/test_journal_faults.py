"""End-to-end: faults at the journal's own steps (store/journal.py), injected into the
real writer process (AMQPBROKER_STORE_FAULTS: `journal`, a commit's append and
fdatasync; `checkpoint`, LMDB's sync and the journal's header).  A commit that is in
LMDB but could not be journaled is never reported: the writer exits, the broker
replays what was not reported to a new writer, and every message answered Accepted
is there after a kill -9 and a restart; nothing is refused, nothing comes twice."""

from __future__ import annotations

import re

import pytest

from tests.e2e.crash_support import assess, drain, send_durable
from tests.e2e.helpers_delivery import uid

pytestmark = pytest.mark.e2e

FAULTS = [
    "journal:EIO@20*1",         # a commit's journal append fails: the writer is lost
    "checkpoint:EIO@1*1",       # the first checkpoint after the start one fails (idle or half full)
]


@pytest.mark.parametrize("spec", FAULTS)
def test_a_journal_fault_loses_no_accepted_message(broker_factory, spec):
    b = broker_factory(env={"AMQPBROKER_STORE_FAULTS": spec})
    q = uid("journal-fault")
    first = send_durable(b, q, 2000, "f")
    b.wait_for_log(re.escape(f"store fault injected at {spec.split(':')[0]}"), timeout=30)
    b.wait_for_log("store writer process lost")
    assert not first.rejected, "a lost writer is replaced and the batches replayed: nothing refused"
    again = send_durable(b, q, 100, "g")
    assert len(again.accepted) == 100, again.rejected
    b.kill()
    b.start()
    got = drain(b.url, q)
    a = assess(first, [m for m in got if m[0].startswith("f")])
    assert not a.lost and a.ok, a.problems()
    assert a.recovered == len(first.accepted) == 2000
    assert sum(1 for m in got if m[0].startswith("g")) == 100
