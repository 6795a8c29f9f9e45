"""Makes store-format1.tar.gz: a data dir written by the broker before the topic log
(store format 1: every durable subscription queue keeps an entry per message), for
tests/e2e/test_store_upgrade.py.  It was run once, at commit d16b875, from the
project root: `.venv/bin/python -m tests.e2e.data.make_store_format1`; running it
on a later tree writes the later format and the upgrade test no longer tests one.

What the store holds (the test checks every message of it after the upgrade):
- `upgrade-client` durable subscription `plain` on amq.topic/upgrade.# : m00..m19;
  m00..m04 accepted, m05..m07 delivered and not settled when the broker was killed;
- the same client's durable subscription `some` with selector `n < 6 OR n > 15`;
- the shared global durable subscription `shared` (link `shared|global`);
- point-to-point queue `upgrade-queue`: q00..q10;
- a durable subscription on amq.topic/other (`idle`) that got nothing.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from proton import Message

from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.e2e.jms_links import durable_consumer, shared_consumer

OUT = Path(__file__).resolve().parent / "store-format1.tar.gz"
TOPIC = "amq.topic/upgrade.#"


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="store-format1-"))
    b = BrokerProcess(tmp / "data").start()
    url = f"amqp://127.0.0.1:{b.ports['amqp']}"
    try:
        sub = connect(url, container_id="upgrade-client")
        plain = durable_consumer(sub, TOPIC, "plain", credit=0)
        some = durable_consumer(sub, TOPIC, "some", selector="n < 6 OR n > 15", credit=0)
        other = connect(url, container_id="upgrade-other")
        shared = shared_consumer(other, TOPIC, "shared", global_=True, credit=0)
        idle = durable_consumer(other, "amq.topic/other", "idle", credit=0)
        for rcv in (some, shared, idle):
            rcv.link.detach()
        pub = connect(url)
        snd = pub.create_sender("amq.topic/upgrade.prices")
        for i in range(20):
            snd.send(Message(body=f"m{i:02d}", durable=True, properties={"n": i}))
        snd.send(Message(body="volatile", durable=False, properties={"n": 100}))
        q = pub.create_sender("upgrade-queue")
        for i in range(10):
            q.send(Message(body=f"q{i:02d}", durable=True))
        plain.flow(8)
        got = [plain.receive(timeout=10) for _ in range(8)]
        assert [m.body for m in got] == [f"m{i:02d}" for i in range(8)]
        for _ in range(5):
            plain.accept()
        pub.close()
        # The five acceptances on their way: a message on another link of the same
        # connection is answered after them.
        probe = sub.create_sender("upgrade-queue")
        probe.send(Message(body="q10", durable=True))
        b.kill()
        with tarfile.open(OUT, "w:gz") as tar:
            tar.add(tmp / "data" / "store", arcname="store")
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
