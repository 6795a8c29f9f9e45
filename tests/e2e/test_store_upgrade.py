"""A store written by the broker before the topic log (tests/e2e/data/store-format1.tar.gz,
made by make_store_format1.py: durable subscriptions stored as an entry per message)
starts on today's broker with every message: the subscriptions are upgraded to the
topic log at the first start, their backlogs, selectors and delivery counts intact,
and a point-to-point queue beside them is untouched."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from proton import Timeout

from tests.client import connect, receive_all
from tests.e2e.jms_links import durable_consumer, shared_consumer

pytestmark = pytest.mark.e2e

FIXTURE = Path(__file__).resolve().parent / "data" / "store-format1.tar.gz"
TOPIC = "amq.topic/upgrade.#"


def old_store_broker(broker_factory):
    b = broker_factory(start=False)
    b.data_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(b.data_dir, filter="data")
    (b.data_dir / "store" / "broker.lock").unlink(missing_ok=True)
    return b.start()


def take(rcv, n: int, timeout: float = 5.0) -> list:
    """Receive up to n (fewer when nothing more comes), accepting each."""
    out = []
    for _ in range(n):
        try:
            out.append(rcv.receive(timeout=timeout))
        except Timeout:
            break
        rcv.accept()
    return out


def test_a_store_of_per_entry_subscriptions_restarts_with_every_message(broker_factory):
    b = old_store_broker(broker_factory)
    b.wait_for_log(r"store upgraded: 4 durable subscription queue\(s\) now in the topic log")
    sub = connect(b.url, container_id="upgrade-client")
    other = connect(b.url, container_id="upgrade-other")
    try:
        plain = take(durable_consumer(sub, TOPIC, "plain", credit=50), 50, timeout=2)
        assert [m.body for m in plain] == [f"m{i:02d}" for i in range(5, 20)]
        # m05..m07 were delivered and not settled when the old broker was killed (and
        # its delivery watermark covered the rest): they come back redelivered.
        assert all(m.delivery_count >= 1 for m in plain[:3])
        some = take(durable_consumer(sub, TOPIC, "some", selector="n < 6 OR n > 15", credit=50), 50, timeout=2)
        assert [m.body for m in some] == [f"m{i:02d}" for i in [0, 1, 2, 3, 4, 5, 16, 17, 18, 19]]
        assert all(m.delivery_count == 0 for m in some)
        shared = take(shared_consumer(other, TOPIC, "shared", global_=True, credit=50), 50, timeout=2)
        assert [m.body for m in shared] == [f"m{i:02d}" for i in range(20)]
        assert take(durable_consumer(other, "amq.topic/other", "idle", credit=10), 10, timeout=0.5) == []
    finally:
        sub.close()
        other.close()
    assert [m.body for m in receive_all(b.url, "upgrade-queue")] == [f"q{i:02d}" for i in range(11)]


def test_an_upgraded_store_goes_on_across_restarts(broker_factory):
    b = old_store_broker(broker_factory)
    sub = connect(b.url, container_id="upgrade-client")
    try:
        rcv = durable_consumer(sub, TOPIC, "plain", credit=5)
        assert [m.body for m in take(rcv, 5)] == [f"m{i:02d}" for i in range(5, 10)]
        rcv.detach()
        # Acknowledgements are not answered: a durable message sent after them on the
        # same connection is Accepted once the store has committed them too.
        sub.create_sender("upgrade-queue").send(_durable("probe", 0))
    finally:
        sub.close()
    b.kill()
    b.start()
    assert "store upgraded" not in b.log_text()            # once only
    sub = connect(b.url, container_id="upgrade-client")
    pub = connect(b.url)
    try:
        pub.create_sender("amq.topic/upgrade.late").send(_durable("late", 99))
        got = take(durable_consumer(sub, TOPIC, "plain", credit=50), 50, timeout=2)
        assert [m.body for m in got] == [f"m{i:02d}" for i in range(10, 20)] + ["late"]
        some = take(durable_consumer(sub, TOPIC, "some", selector="n < 6 OR n > 15", credit=50), 50, timeout=2)
        assert [m.body for m in some][-1] == "late" and len(some) == 11
    finally:
        sub.close()
        pub.close()


def _durable(body: str, n: int):
    from proton import Message
    return Message(body=body, durable=True, properties={"n": n})
