"""End-to-end: selectors whose every evaluation stays within its budget (ten LIKEs
with `_` between literals, ~3 Mi steps each against a 1 MiB property; 512 KiB here) still cost a
lot per message, and used to be evaluated back to back on the broker's one loop:
a consumer's attach over 40 such messages held it 7.8 s, one message routed to a
topic with 20 such subscriptions 3.3 s.  Now a scan yields once a loop turn spent
its selector budget, and the subscriptions one message is routed through share one
evaluation budget (core/selectors/like.py).  A canary's round trips are compared
with those of an idle broker's canary over the same seconds (tests/e2e/canary.py)."""

from __future__ import annotations

import time

import pytest
from proton import Message

from tests.client import SourceOptions, connect
from tests.e2e.canary import Canary

pytestmark = pytest.mark.e2e

COSTLY = " OR ".join(f"p LIKE '%a_{c}%'" for c in "bcdefghijk")
BIG = "a" * (1 << 19)


def test_costly_selectors_do_not_hold_the_loop(broker_factory):
    control = broker_factory(name="control")
    broker = broker_factory(name="attacked")
    conn = connect(broker.url)
    try:
        for i in range(20):   # subscriptions of topic t, each with the costly selector
            conn.create_receiver("amq.topic/t", name=f"sub{i}", credit=0,
                                 options=SourceOptions(selector=COSTLY, durable=2, expiry=0,
                                                       capabilities=["topic", "shared"]))
        snd = conn.create_sender("big")
        for _ in range(40):
            snd.send(Message(body="b", properties={"p": BIG}, durable=False))
        with Canary(control) as idle, Canary(broker) as canary:
            time.sleep(0.5)
            conn.create_sender("amq.topic/t").send(Message(body="t", properties={"p": BIG}, durable=False))
            rcv = conn.create_receiver("big", credit=40, options=SourceOptions(selector=COSTLY))
            time.sleep(2)
            rcv.close()
            time.sleep(0.5)
        canary.assert_like(idle, floor=0.5)
    finally:
        conn.close()
