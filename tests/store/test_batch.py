"""Batch: the coalescing of one loop turn's store writes (store/batch.py), without
LMDB: what a batch would write is read off its dictionaries."""

from __future__ import annotations

from amqpbroker.core.message import Message
from amqpbroker.core.queues import Entry
from amqpbroker.store.base import EntryRecord
from amqpbroker.store.batch import ENTRY_KEY, U64, Batch, encode_entry
from amqpbroker.store.reads import _decode_entry


def key(qid: int, seq: int) -> bytes:
    return ENTRY_KEY.pack(qid, seq)


def test_written_then_removed_entries_and_messages_cancel_out():
    b = Batch()
    b.put_message(10, b"ten")
    b.put_entry(1, EntryRecord(1, 10, 0))
    b.update_entry(1, EntryRecord(1, 10, 0, True))
    b.delete_entry(1, 1)
    b.drop_message(10)
    b.delete_entry(1, 99)            # an entry from an earlier batch: deleted on disk
    b.drop_message(7)
    b.put_message(11, b"eleven")
    b.put_entry(1, EntryRecord(2, 11, 0))
    b.update_entry(1, EntryRecord(2, 11, 0, True))
    b.seal()
    assert b.msg_puts == {U64.pack(11): b"eleven"}
    assert b.msg_dels == {U64.pack(7)}
    assert b.entry_puts == {key(1, 2): encode_entry(EntryRecord(2, 11, 0, True))}
    assert b.entry_dels == {key(1, 99)}
    assert b.new_keys == [key(1, 2)]
    assert b.last_seq == {1: 2}, "the high-water mark counts the cancelled entry too"
    assert b.max_msg_id == 11
    assert b.ops == 10


def test_an_update_of_an_entry_stored_earlier_is_encoded_at_once():
    b = Batch()
    rec = EntryRecord(5, 50, 1, True)
    b.update_entry(3, rec)
    rec.delivery_count = 9               # a snapshot: later changes are not seen
    assert _decode_entry(5, b.entry_puts[key(3, 5)]) == EntryRecord(5, 50, 1, True)
    b.delete_entry(3, 5)
    b.update_entry(3, EntryRecord(5, 50, 2))   # removed in this batch: stays removed
    assert key(3, 5) not in b.entry_puts and b.entry_dels == {key(3, 5)}


def test_a_live_entry_is_written_as_it_is_at_hand_over():
    """A durable entry delivered in the turn it arrived is written once, already
    marked delivered (no second write for the mark); one released again is not."""
    msg = Message(b"\x00\x53\x70\x45\x00\x53\x75\xa0\x01x")
    delivered, returned = Entry(msg, 1), Entry(msg, 2)
    for e in (delivered, returned):
        e.store_ref = 42
    b = Batch()
    b.put_entry(4, delivered)
    b.put_entry(4, returned)
    delivered.consumer = object()             # a consumer took it this turn
    returned.delivery_count = 1               # taken, then modified (delivery-failed) back
    b.seal()
    got = {k: _decode_entry(ENTRY_KEY.unpack(k)[1], v) for k, v in b.entry_puts.items()}
    assert got[key(4, 1)].delivered is True and got[key(4, 1)].delivery_count == 0
    assert got[key(4, 2)].delivered is False and got[key(4, 2)].delivery_count == 1
    assert got[key(4, 1)].msg_id == 42 and got[key(4, 1)].size == msg.size
    assert b.entry_new == {} and set(b.new_keys) == {key(4, 1), key(4, 2)}


def test_removals_only_keeps_all_but_what_the_batch_adds():
    """A failed commit still writes removals, updates and entity records (the broker
    applied them in memory: a queue declared in a failed batch holds the messages it
    accepts next, which a restart would drop without its record)."""
    b = Batch()
    b.put_message(1, b"new")
    b.put_entry(1, EntryRecord(1, 1, 0))
    b.update_entry(1, EntryRecord(7, 3, 1, True))   # stored earlier: an update, kept
    b.delete_entry(2, 4)
    b.drop_message(9)
    b.put_meta("put", "queues", b"q", b"{}")
    b.put_meta("del", "bindings", b"x", None)
    b.seal()
    r = b.removals_only()
    assert r.msg_puts == {} and r.msg_dels == {U64.pack(9)}
    assert set(r.entry_puts) == {key(1, 7)} and r.entry_dels == {key(2, 4)}
    assert r.meta == [("put", "queues", b"q", b"{}"), ("del", "bindings", b"x", None)]


def one_of_each() -> Batch:
    """A new message and entry, an update of a stored entry, a removal of each kind and
    an entity record."""
    b = Batch()
    b.put_message(1, b"new")
    b.put_entry(1, EntryRecord(1, 1, 0))
    b.update_entry(1, EntryRecord(7, 3, 1, True))
    b.delete_entry(2, 4)
    b.drop_message(9)
    b.put_meta("put", "queues", b"q", b"{}")
    return b


def test_a_failed_batch_turns_what_it_adds_into_deletes_and_keeps_the_rest():
    """Failed before or after sealing: its new entries and messages become deletes
    (a writer that died may have committed them unreported) and are the lost keys;
    removals, updates of stored entries and entity records stay."""
    for sealed in (False, True):
        b = one_of_each()
        b.callbacks.append(print)
        if sealed:
            b.seal()
        error = RuntimeError("no")
        b.fail(error)
        assert b.error is error and b.callbacks == [print]
        assert b.new_keys == [key(1, 1)]
        assert b.entry_new == {} and set(b.entry_puts) == {key(1, 7)}
        assert b.entry_dels == {key(2, 4), key(1, 1)}
        assert b.msg_puts == {} and b.msg_dels == {U64.pack(9), U64.pack(1)}
        assert b.meta == [("put", "queues", b"q", b"{}")]
        assert b.last_seq == {1: 1}, "the sequence high-water mark still goes: sequences never go back"


def test_an_abandoned_batch_writes_its_removals_and_entity_records_and_nothing_it_adds():
    """abandon(): fail() could not finish (no memory), maybe half-way through moving new
    entries to deletes.  Nothing new may be written (its producers are told it
    failed), but the entity records must be: the broker made that queue in memory
    and stores what it accepts next under it (without its record a restart drops
    those messages).  Removals stay too; a lost update only brings a duplicate."""
    for sealed in (False, True):
        b = one_of_each()
        b.put_live("cursors", b"c", _Live(b"cursor"))
        if sealed:
            b.seal()
        error = MemoryError("no")
        b.abandon(error)
        assert b.error is error
        assert b.entry_new == {} and b.entry_puts == {} and b.msg_puts == {} and b.live == {}
        assert b.entry_dels == {key(2, 4)} and b.msg_dels == {U64.pack(9)}
        assert ("put", "queues", b"q", b"{}") in b.meta
        assert b.last_seq == {1: 1} and b.max_msg_id == 1, "ids and sequences never go back"
        r = b.removals_only()
        assert r.meta[0] == ("put", "queues", b"q", b"{}") and r.entry_puts == {}


class _Live:
    """A state encoded when the batch is sealed (a subscription's cursor)."""

    def __init__(self, value: bytes):
        self.value = value

    def encode(self) -> bytes:
        return self.value


def test_live_state_is_encoded_once_at_seal_as_it_is_then():
    b = Batch()
    state = _Live(b"first")
    for _ in range(3):
        b.put_live("cursors", b"k1", state)
    state.value = b"last"
    b.put_live("cursors", b"k2", _Live(b"x"))
    b.put_live("cursors", b"k2", None)               # deleted later in the same turn
    b.seal()
    assert b.live == {}
    assert b.meta == [("set", "cursors", b"k1", b"last"), ("del", "cursors", b"k2", None)]


def test_entity_and_set_records_are_kept_by_a_failed_or_full_batch():
    b = Batch()
    b.put_meta("put", "queues", b"q", b"{}")
    b.put_meta("set", "routes", b"r", b"[]")
    b.put_live("cursors", b"c", _Live(b"cursor"))
    b.seal()
    assert [op[0] for op in b.removals_only().meta] == ["put", "set", "set"]
    b.fail(RuntimeError("x"))
    assert [op[0] for op in b.meta] == ["put", "set", "set"]   # fail() keeps entity records as before


def test_an_encoded_new_entry_is_written_as_given_and_lost_like_any_new_one():
    b = Batch()
    b.put_entry_bytes(0, 7, b"record")
    b.seal()
    assert b.entry_puts == {key(0, 7): b"record"} and b.new_keys == [key(0, 7)] and b.last_seq == {0: 7}
    b.fail(RuntimeError("x"))
    assert b.entry_puts == {} and key(0, 7) in b.entry_dels
