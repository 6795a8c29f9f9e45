"""The store's HA hooks (store/channel.py): every framed batch is shown to the
replica, and commit callbacks wait for the replica's gate as well as the local
commit; a replica detached (closing, fenced) holds nothing back."""

from __future__ import annotations

import asyncio

import pytest

from amqpbroker.core.ha import ReplicaTracker
from amqpbroker.store import writer as writer_proc
from tests.store.helpers import put


class FakeReplica:
    def __init__(self):
        self.tracker = ReplicaTracker(synchronous=True, timeout=60)
        self.frames: list[tuple[int, bytes]] = []

    def framed(self, number, data):
        self.frames.append((number, data))

    def gate(self, local):
        return self.tracker.gate(local)


def run_briefly(loop, seconds=0.5):
    loop.run_until_complete(asyncio.sleep(seconds))


@pytest.fixture
def gated(opened):
    """An open store with a replica attached and in sync: (store, replica)."""
    store = opened()
    replica = FakeReplica()
    store.replica = replica
    replica.tracker.attach(store.batch, store.batch - 1)
    replica.tracker.on_ack(store.batch - 1)
    assert replica.tracker.state.value == "in-sync"
    return store, replica


def test_callbacks_wait_for_the_replica_then_run_in_order(gated, loop):
    store, replica = gated
    seen = []
    put(store, 1, 1, b"one")
    store.after_commit(lambda err: seen.append(("one", err)))
    run_briefly(loop)
    assert store.committed_upto >= 0, "committed locally"
    assert seen == [], "not before the replica has it too"
    number, data = replica.frames[-1]
    assert writer_proc.take_frames(bytearray(data))[0][0] == "batch", "the writer's own frame is shown"
    replica.tracker.sent_batch(number, 0.0)
    replica.tracker.on_ack(number)
    store.replica_committed()
    assert seen == [("one", None)]


def test_a_replica_ahead_of_the_local_commit_waits_for_it(gated, loop):
    store, replica = gated
    seen = []
    put(store, 1, 1, b"x")
    store.after_commit(lambda err: seen.append(err))
    replica.tracker.on_ack(store.batch + 5)    # acknowledged "before" the local commit
    store.replica_committed()
    assert seen == []
    run_briefly(loop)
    assert seen == [None]


def test_detaching_the_replica_releases_what_waits(gated, loop):
    store, replica = gated
    seen = []
    put(store, 1, 1, b"x")
    store.after_commit(lambda err: seen.append(err))
    run_briefly(loop)
    assert seen == []
    store.detach_replica()
    assert seen == [None]
    assert store.replica is None
