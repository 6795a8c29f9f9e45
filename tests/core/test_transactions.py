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
