"""What a node reads from another node's subscription-move link (cluster/moves.py
`moved_subscription`): the record, nothing when unmarked, and a clear refusal when the
record does not read.  Over two proton engines joined in memory (no socket)."""

from __future__ import annotations

import json

import pytest
from proton import Connection, Transport

from amqpbroker.cluster.moves import MOVE, moved_subscription
from amqpbroker.core.queues import ExclusivityPolicy, LifetimePolicy
from amqpbroker.core.subscriptions import BindingSpec, Subscription, SubscriptionKey
from amqpbroker.core.terms import Durability, ExpiryPolicy, SourceTerms
from amqpbroker.server.refusal import AttachRefused
from amqpbroker.store.subscription_json import subscription_to_json

KEY = SubscriptionKey("app", "sub", True)
SUB = Subscription(KEY, KEY.queue_name, ExclusivityPolicy.LINK, LifetimePolicy.PERMANENT,
                   BindingSpec("amq.topic", "prices", "x = 1", True),
                   SourceTerms(address="amq.topic/prices", durable=Durability.UNSETTLED_STATE,
                               expiry_policy=ExpiryPolicy.NEVER, capabilities=frozenset({"topic"})),
                   "app", 12.5, {"sub"})


def arrived(properties: dict | None):
    """The link as the receiving node sees it, attached by a sender with `properties`."""
    near, far = Connection(), Connection()
    t_near, t_far = Transport(), Transport(Transport.SERVER)
    t_near.bind(near)
    t_far.bind(far)
    near.open()
    ssn = near.session()
    ssn.open()
    snd = ssn.sender("amqpbroker:shovel:n0:" + KEY.queue_name)
    snd.target.address = KEY.queue_name
    if properties is not None:
        snd.properties = properties
    snd.open()
    for _ in range(4):   # pump the frames both ways
        for src, dst in ((t_near, t_far), (t_far, t_near)):
            out = src.peek(src.pending()) if src.pending() > 0 else b""
            if out:
                dst.push(out)
                src.pop(len(out))
    link = far.link_head(0)
    assert link is not None and link.remote_target.address == KEY.queue_name
    return link


def test_the_record_comes_back_as_it_was_stored():
    moved = moved_subscription(arrived({MOVE: json.dumps(subscription_to_json(SUB))}))
    assert moved == SUB


def test_an_unmarked_link_is_no_move():
    assert moved_subscription(arrived(None)) is None
    assert moved_subscription(arrived({"other": "x"})) is None


@pytest.mark.parametrize("text", ["not json", "{}", json.dumps({"key": ["a"]}), "[1, 2]"])
def test_a_record_that_does_not_read_is_refused_clearly(text):
    with pytest.raises(AttachRefused) as refused:
        moved_subscription(arrived({MOVE: text}))
    assert refused.value.condition == "amqp:invalid-field" and "does not read" in refused.value.description
