"""core/transactions.py: the registry of open transactions, fed txn-ids as peers send them."""

from __future__ import annotations

import pytest
from proton import Described, int32, uint, ulong

from amqpbroker.core.transactions import (
    INVALID_FIELD,
    MAX_TXN_ID,
    UNKNOWN_ID,
    TransactionError,
    TransactionRegistry,
)


def test_a_declared_transaction_is_found_by_its_id_then_taken():
    txns = TransactionRegistry()
    txn = txns.declare(owner="conn")
    assert len(txn.txn_id) <= MAX_TXN_ID
    assert txns.get(txn.txn_id) is txn
    assert txns.get(memoryview(txn.txn_id)) is txn
    assert txns.take(bytearray(txn.txn_id)) is txn
    with pytest.raises(TransactionError) as err:
        txns.get(txn.txn_id)
    assert err.value.condition == UNKNOWN_ID


@pytest.mark.parametrize("txn_id", [int32(-1), ulong(2**63), uint(1_413_697_690), 7, "abc", None,
                                    Described(ulong(1), None), [b"x"]],
                         ids=["negative", "huge", "1.4e9", "int", "string", "null", "described", "list"])
def test_a_txn_id_that_is_not_binary_names_no_transaction_and_allocates_nothing(txn_id):
    txns = TransactionRegistry()
    txns.declare(owner="conn")
    with pytest.raises(TransactionError) as err:
        txns.get(txn_id)
    assert err.value.condition == INVALID_FIELD
    assert "binary" in err.value.description


def test_an_overlong_txn_id_is_unknown_and_not_echoed_whole():
    txns = TransactionRegistry()
    txn = txns.declare(owner="conn")
    with pytest.raises(TransactionError) as err:
        txns.get(txn.txn_id + b"\x00" * 1_000_000)
    assert err.value.condition == UNKNOWN_ID
    assert len(err.value.description) < 200


# ---------------------------------------------------------------------- queue limits


def _limited_broker():
    from amqpbroker.core.broker import Broker, BrokerPolicy
    from amqpbroker.core.limits import LimitRule, Overflow, QueueLimits

    b = Broker(BrokerPolicy(queue_limits=(LimitRule("rej.#", QueueLimits(5, 0, Overflow.REJECT)),
                                          LimitRule("blk.#", QueueLimits(5, 0, Overflow.BLOCK)))))
    b.declare_exchange("ex", "fanout")
    for name in ("rej.q", "blk.q", "free"):
        b.bind("ex", "", b.declare_queue(name))
    return b


def _to(name, kind=None):
    from amqpbroker.core.addresses import AddressKind, Resolution

    return Resolution(kind or AddressKind.QUEUE, name)


def test_staged_sends_count_against_limited_queues_and_refuse_beyond_a_reject_limit():
    from amqpbroker.core.broker import QueueFull
    from tests.core.helpers import make_message

    b, txns = _limited_broker(), TransactionRegistry()
    rej, blk, free = b.queues["rej.q"], b.queues["blk.q"], b.queues["free"]
    t1, t2 = txns.declare("c1"), txns.declare("c2")
    for i in range(3):
        txns.stage(t1, make_message(f"m{i}"), _to("rej.q"), b)
    for i in range(2):
        txns.stage(t2, make_message(f"n{i}"), _to("rej.q"), b)
    with pytest.raises(QueueFull, match="5 staged by open transactions"):
        txns.stage(t2, make_message("ov"), _to("rej.q"), b)     # 5 staged already: nothing more fits
    assert len(t2.sends) == 2 and rej.overflow_rejected_total == 1 and rej.depth == 0
    txns.stage(t1, make_message("bb"), _to("blk.q"), b)          # block: counted, never refused here
    txns.stage(t1, make_message("ff"), _to("free"), b)
    size = make_message("xx").size
    assert txns.staged_on(rej) == (5, 5 * size) and txns.staged_on(blk) == (1, size)
    assert txns.staged_on(free) == (0, 0), "unlimited queues are not counted"
    with pytest.raises(QueueFull):
        txns.stage(t1, make_message("fan"), _to("ex", _exchange()), b)   # the fan-out reaches rej.q
    txns.rollback(txns.take(t2.txn_id))
    assert txns.staged_on(rej) == (3, 3 * size)
    txns.commit(txns.take(t1.txn_id), b)
    assert (rej.depth, blk.depth, free.depth) == (3, 1, 1)
    assert txns.staged_on(rej) == (0, 0) and txns.staged_on(blk) == (0, 0)


def _exchange():
    from amqpbroker.core.addresses import AddressKind

    return AddressKind.EXCHANGE


def test_a_commit_that_would_take_a_reject_queue_over_fails_and_changes_nothing():
    from amqpbroker.core.transactions import RESOURCE_LIMIT
    from tests.core.helpers import make_message

    b, txns = _limited_broker(), TransactionRegistry()
    rej, free = b.queues["rej.q"], b.queues["free"]
    txn = txns.declare("c")
    for i in range(3):
        txns.stage(txn, make_message(i), _to("rej.q"), b)
    txns.stage(txn, make_message("f"), _to("free"), b)
    for i in range(3):                   # others fill it meanwhile (within the limit when they came)
        b.publish(make_message(f"p{i}"), _to("rej.q"))
    with pytest.raises(TransactionError) as err:
        txns.commit(txn, b)
    assert err.value.condition == RESOURCE_LIMIT and "'rej.q'" in err.value.description
    assert rej.depth == 3 and free.depth == 0, "nothing of it applied"
    assert txns.committed_total == 0


def test_a_commit_checks_a_queue_it_creates_against_the_limits_it_will_get():
    from amqpbroker.core.addresses import AddressKind
    from tests.core.helpers import make_message

    b, txns = _limited_broker(), TransactionRegistry()
    txn = txns.declare("c")
    for i in range(5):
        txns.stage(txn, make_message(i), _to("rej.new", AddressKind.NEW_QUEUE), b)
    from amqpbroker.core.broker import QueueFull
    with pytest.raises(QueueFull):
        txns.stage(txn, make_message(5), _to("rej.new", AddressKind.NEW_QUEUE), b)
    txns.commit(txn, b)
    assert b.queues["rej.new"].depth == 5


def test_a_rollback_gives_the_room_back_to_waiting_producers():
    from tests.core.helpers import make_message

    b, txns = _limited_broker(), TransactionRegistry()
    blk = b.queues["blk.q"]
    txn = txns.declare("c")
    txns.stage(txn, make_message(1), _to("blk.q"), b)
    woken = []
    blk.wait_for_room(woken.append)
    txns.rollback(txns.take(txn.txn_id))
    assert woken == [blk] and txns.staged_on(blk) == (0, 0)


def test_a_transaction_is_found_only_by_the_connection_that_declared_it():
    """txn-ids are this broker's prefix and a counter: a client that declares one of
    its own knows the ids of everyone else's.  Another connection could send into a
    transaction, commit it early or roll it back (its owner's commit then failed with
    unknown-id).  To any other connection the id names no transaction."""
    txns = TransactionRegistry()
    mine = txns.declare(owner="conn-a")
    with pytest.raises(TransactionError) as err:
        txns.get(mine.txn_id, owner="conn-b")
    assert err.value.condition == UNKNOWN_ID
    with pytest.raises(TransactionError):
        txns.take(mine.txn_id, owner="conn-b")
    assert txns.get(mine.txn_id, owner="conn-a") is mine
    assert txns.take(mine.txn_id, owner="conn-a") is mine
