"""A broker with durable subscriptions on a real LmdbStore, started like
BrokerServer.start (recovery, then hooks), for the topic log tests.  No mocks: a
real LMDB in tmp_path, the real writer process, a real asyncio loop."""

from __future__ import annotations

import struct

from amqpbroker.core.addresses import AddressKind, Resolution
from amqpbroker.core.broker import Broker, BrokerPolicy
from amqpbroker.core.budget import MemoryBudget
from amqpbroker.core.queues import Outcome, Queue
from amqpbroker.core.registry import SubscriptionRegistry, subscription_filter
from amqpbroker.core.subscriptions import BindingSpec, Decision
from amqpbroker.core.terms import Durability, ExpiryPolicy, SourceTerms
from amqpbroker.store.durability import DurabilityManager
from amqpbroker.store.lmdb_store import LmdbStore
from tests.core.helpers import RecordingConsumer, bodies, make_message
from tests.store.helpers import commit


class LogRig:
    def __init__(self, path, loop, *, queue_budget: int = 16 << 20, budget: int = 0,
                 policy: BrokerPolicy | None = None):
        self.loop = loop
        self.store = LmdbStore(path)
        self.broker = Broker(policy)
        if budget:
            self.broker.budget = MemoryBudget(budget)
        self.registry = SubscriptionRegistry(self.broker, subscription_filter)
        self.dm = DurabilityManager(self.broker, self.registry, self.store, memory_budget=queue_budget)
        self.dm.recover(self.store.open(loop), subscription_filter)
        self.dm.install()

    # ---- model

    def subscribe(self, name: str, key: str = "news.#", *, selector: str | None = None,
                  container: str = "cid", shared: bool = False) -> Queue:
        caps = {"topic"} | ({"shared"} if shared else set())
        source = SourceTerms(address=f"amq.topic/{key}", durable=Durability.UNSETTLED_STATE,
                             expiry_policy=ExpiryPolicy.NEVER, capabilities=frozenset(caps))
        spec = BindingSpec("amq.topic", key, selector, False)
        d = self.registry.decide(name, container, source, spec)
        assert d.decision is not Decision.REFUSE, d
        _, queue = self.registry.apply(d, link_name=name, container_id=container, owner=None, now=0.0)
        return queue

    def unsubscribe(self, queue: Queue) -> None:
        self.registry.delete(self.registry.by_queue[queue.name])

    def publish(self, key: str, n: int = 1, start: int = 0, durable: bool = True, **fields) -> None:
        for i in range(start, start + n):
            msg = make_message(f"m{i:02d}", durable=durable, subject=key, properties={"n": i}, **fields)
            self.broker.publish(msg, Resolution(AddressKind.EXCHANGE, "amq.topic", key))

    def queue(self, name: str, container: str = "cid") -> Queue:
        return self.broker.queues[f"qpidsub_/{container}_/{name}_/durable"]

    # ---- store

    def commit(self, timeout: float = 20.0):
        """Run the loop until everything queued so far is committed; its error."""
        return commit(self.loop, self.store, timeout)

    def close(self):
        self.commit()
        self.store.close()

    def crash(self):
        """Everything queued so far committed, then the store closed without the clean
        stop's last writes (what kill -9 after the last commit leaves)."""
        self.commit()
        self.store.on_closing = None
        self.store.close()

    def log_records(self) -> list:
        return self.store.scan_log(lambda pos, val: pos)

    def entries_of(self, queue: Queue) -> int:
        return self.store.count_entries(queue.store_id)

    def messages(self) -> int:
        with self.store._read_lock, self.store._begin() as txn:
            return txn.stat(self.store._dbs["messages"])["entries"]

    def cursor_record(self, queue: Queue) -> bytes | None:
        with self.store._read_lock, self.store._begin() as txn:
            return txn.get(struct.pack(">I", queue.store_id), db=self.store._dbs["cursors"])


def drain(queue: Queue, n: int = 10_000, outcome: Outcome = Outcome.ACCEPTED) -> list:
    """Take up to n messages with one consumer, settle them with `outcome`, detach."""
    c = RecordingConsumer(credit=n)
    queue.add_consumer(c)
    got = list(c.delivered)
    for entry in got:
        queue.settle(entry, outcome)
    queue.remove_consumer(c, [], failed=False)
    return got


def names(entries) -> list:
    return bodies(entries)
