"""Store safety, end to end with the real broker process:

* one broker per data dir (a second one exits 2 naming the first's PID; kill -9
  leaves no stale lock);
* a store that is not whole stops the broker with exit status 2 and one line that
  says what is wrong, within seconds, never a signal death or a silent empty start;
  `amqpbroker store check` says the same; `store backup` / `store restore` bring it
  back;
* faults injected on the store path (AMQPBROKER_STORE_FAULTS, store/faults.py): the
  broker keeps running, and every message it answered Accepted is there after a
  kill -9 and a restart; messages answered Rejected are not.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from amqpbroker.store.faults import Faults
from tests.broker_process import BrokerProcess
from tests.e2e.crash_support import Traffic, assess, drain, send_durable

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "amqpbroker.cli"]
QUEUE = "safety"
MESSAGES = 2000


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run_cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout)


def failed_start(broker: BrokerProcess, timeout: float = 20.0) -> tuple[int, str, float]:
    """Start a broker that must not start: (exit status, its output, seconds)."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited during start-up") as failed:
        broker.start(timeout=timeout)
    broker.proc.wait(10)
    return broker.proc.returncode, str(failed.value), time.monotonic() - started


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if " ERROR " in ln]


# ---------------------------------------------------------------------- one broker per data dir


def test_a_second_broker_on_the_same_data_dir_exits_2_naming_the_first(broker_factory):
    first = broker_factory()
    second = broker_factory(start=False)               # same data dir, its own ports (--port 0)
    assert second.data_dir == first.data_dir
    status, text, seconds = failed_start(second)
    assert status == 2, text
    errors = error_lines(text)
    assert len(errors) == 1 and "Traceback" not in text, text
    assert f"cannot start: store at {first.data_dir / 'store'} is in use by process {first.proc.pid} " in errors[0]
    assert seconds < 15
    # The first one is unharmed.
    sent = send_durable(first, QUEUE, 10, "first")
    assert len(sent.accepted) == 10


def test_after_kill_9_the_next_broker_starts_on_the_store_and_loses_nothing(broker_factory):
    b = broker_factory()
    sent = send_durable(b, QUEUE, 300, "k9")
    assert len(sent.accepted) == 300
    old = b.proc.pid
    b.kill()                                         # the lock goes with the process
    b.start()
    assert (b.data_dir / "store" / "broker.lock").read_text().split() == [str(b.proc.pid)] != [str(old)]
    got = drain(b.url, QUEUE)
    a = assess(sent, got)
    assert a.ok and a.recovered == 300, a.problems()


# ---------------------------------------------------------------------- a store that is not whole


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A data dir whose store holds MESSAGES durable messages (built once)."""
    data = tmp_path_factory.mktemp("pristine") / "data"
    b = BrokerProcess(data).start()
    try:
        sent = send_durable(b, QUEUE, MESSAGES, "p")
        assert len(sent.accepted) == MESSAGES
    finally:
        assert b.stop() == 0
    return data


def copy_of(pristine: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(pristine, data)
    return data


def _truncate(size_of):
    def damage(store: Path) -> None:
        f = store / "data.mdb"
        os.truncate(f, size_of(f.stat().st_size))
    return damage


def _garbage(start, length):
    def damage(store: Path) -> None:
        f = store / "data.mdb"
        rng = random.Random(7)
        size = f.stat().st_size
        n = length(size)
        with open(f, "r+b") as fh:
            fh.seek(start)
            fh.write(bytes(rng.getrandbits(8) for _ in range(n)))
    return damage


DAMAGE = {
    "truncated-to-half": (_truncate(lambda n: n // 2), r"data\.mdb is \d+ bytes but its meta page .* the file was truncated"),
    "truncated-to-8k": (_truncate(lambda n: 8192), r"data\.mdb is 8192 bytes but its meta page .* the file was truncated"),
    "truncated-to-0": (_truncate(lambda n: 0), r"data\.mdb is empty \(0 bytes\) but store\.state says this directory held a store"),
    "deleted": (lambda store: (store / "data.mdb").unlink(), r"data\.mdb is missing but store\.state says this directory held a store"),
    "garbage-data-pages": (_garbage(8192, lambda n: n - 8192), r"is damaged: (database|LMDB|reading the store killed)"),
    "garbage-meta-page": (_garbage(4096, lambda n: 4096), r"meta page 1 of data\.mdb is not an LMDB meta page"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_store_that_is_not_whole_stops_the_broker_with_exit_2_and_one_clear_line(pristine, tmp_path,
                                                                                   broker_factory, damage):
    data = copy_of(pristine, tmp_path)
    store = data / "store"
    harm, expected = DAMAGE[damage]
    harm(store)
    broker = broker_factory(start=False)
    assert broker.data_dir == data
    status, text, seconds = failed_start(broker)
    assert status == 2, f"exit status {status} (negative: killed by a signal):\n{text}"
    assert seconds < 15
    assert "Traceback" not in text, text
    errors = error_lines(text)
    assert len(errors) == 1, text
    assert re.search(expected, errors[0]), errors[0]
    assert f"cannot start: store at {store} " in errors[0]
    assert f"amqpbroker store check --data-dir {data}" in errors[0], "it says how to go on"
    # Nothing was started empty over it.
    if damage in ("truncated-to-0", "deleted"):
        assert not (store / "data.mdb").exists() or (store / "data.mdb").stat().st_size == 0
    check = run_cli(["store", "check", "--data-dir", str(data)])
    assert check.returncode == 2, check.stdout + check.stderr
    assert "NOT WHOLE" in check.stdout and "Traceback" not in check.stderr


def test_store_check_of_a_whole_store_exits_0_with_counts(pristine, tmp_path):
    data = copy_of(pristine, tmp_path)
    check = run_cli(["store", "check", "--data-dir", str(data)])
    assert check.returncode == 0, check.stdout + check.stderr
    assert re.search(rf"messages\s+{MESSAGES:,} record", check.stdout), check.stdout
    assert re.search(rf"entries\s+{MESSAGES:,} record", check.stdout), check.stdout
    assert "result: whole" in check.stdout


def test_store_check_refuses_while_a_broker_runs(broker_factory):
    b = broker_factory()
    check = run_cli(["store", "check", "--data-dir", str(b.data_dir)])
    assert check.returncode == 2
    assert f"in use by process {b.proc.pid}" in check.stderr and "stop the broker" in check.stderr


def test_a_backup_taken_while_running_restores_every_message(broker_factory, tmp_path):
    b = broker_factory()
    sent = send_durable(b, QUEUE, 500, "bk")
    backup = tmp_path / "backup"
    copied = run_cli(["store", "backup", str(backup), "--data-dir", str(b.data_dir)])
    assert copied.returncode == 0 and "result: whole" in copied.stdout, copied.stdout + copied.stderr
    b.stop()
    os.truncate(b.data_dir / "store" / "data.mdb", 8192)           # the store is lost
    status, _, _ = failed_start(b)
    assert status == 2
    refused = run_cli(["store", "restore", str(backup), "--data-dir", str(b.data_dir)])
    assert refused.returncode == 2 and "not replaced without --force" in refused.stderr
    restored = run_cli(["store", "restore", str(backup), "--data-dir", str(b.data_dir), "--force"])
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert list((b.data_dir / "store").glob("data.mdb.replaced-*")), "the damaged one is kept aside"
    b.start()
    a = assess(sent, drain(b.url, QUEUE))
    assert a.ok and a.recovered == 500, a.problems()


# ---------------------------------------------------------------------- injected faults


FAULTS = {
    # spec: (the broker rejects some messages, log line that shows the fault was handled)
    "seal:MemoryError@40*3": (True, "degraded: sealing a batch failed: MemoryError"),
    "encode:MemoryError@40*3": (True, "degraded: encoding a batch failed: MemoryError"),
    "pipe-write:ENOSPC@40*2": (True, "degraded: writing to the store writer process failed"),
    "commit:EIO@40*2": (True, "degraded: commit failed in the store writer process"),
    "results:EIO@30*1": (False, "store writer process lost"),
    "result-write:EPIPE@30*1": (False, "store writer process lost"),
}


FAULT_MESSAGES = 3000


def window_reaching(spec: str, messages: int = FAULT_MESSAGES) -> int:
    """The producer's window of unsettled sends that makes the fault fire by count,
    however the machine's load groups the commits.  Every message of one store batch
    is unsettled until the batch is committed, so a batch holds at most `window`
    messages and `messages` sends make at least messages / window batches (hand-overs,
    commits, results): twice the calls the fault needs to have passed and failed.
    (A fixed window of 200 guaranteed 15 commits; `commit:EIO@40*2` needs 42, which
    a busy machine, grouping more per commit, did not always make.)"""
    fault = Faults.parse(spec).by_point
    (point_faults,) = fault.values()
    needed = point_faults[0].after + int(point_faults[0].times)
    return max(1, messages // (2 * needed))


@pytest.mark.parametrize("spec", list(FAULTS))
def test_the_producer_window_guarantees_the_fault_fires(spec):
    fault = next(iter(Faults.parse(spec).by_point.values()))[0]
    assert FAULT_MESSAGES // window_reaching(spec) >= 2 * (fault.after + int(fault.times))


@pytest.mark.parametrize("spec", list(FAULTS))
def test_an_injected_store_fault_loses_no_accepted_message(broker_factory, spec):
    rejects, handled = FAULTS[spec]
    b = broker_factory(env={"AMQPBROKER_STORE_FAULTS": spec})
    q = uniq("fault")
    first = send_durable(b, q, FAULT_MESSAGES, "f", window=window_reaching(spec))
    b.wait_for_log(re.escape(handled))
    if rejects:
        assert first.rejected, "the fault cost some messages their place"
        assert set(first.rejected.values()) == {"amqp:resource-limit-exceeded"}
        b.wait_for_log("recovered after")
        assert len(re.findall(r"degraded: ", b.log_text())) == 1, "one log line for the episode"
        metrics = httpx.get(f"http://127.0.0.1:{b.ports['management']}/metrics", timeout=10).text
        failed = re.search(r"^amqpbroker_store_failed_batches_total (\S+)$", metrics, re.M)
        assert failed and float(failed.group(1)) >= 1, "the failed batches are counted"
        assert re.search(r"^amqpbroker_store_degraded 0\.0$", metrics, re.M), "recovered: no longer degraded"
    else:
        assert not first.rejected, "a lost result stream is replayed, nothing refused"
    # The broker kept running and takes durable messages again.
    again = send_durable(b, q, 100, "g")
    assert len(again.accepted) == 100, again.rejected
    b.kill()
    b.start()
    got = drain(b.url, q)
    both = Traffic("both", sent={**first.sent, **{k: v + 10**6 for k, v in again.sent.items()}},
                   accepted=first.accepted | again.accepted, rejected={**first.rejected, **again.rejected})
    a = assess(both, got)
    assert not a.lost, f"{spec}: accepted messages lost: {a.problems()}"
    assert a.ok, f"{spec}: {a.problems()}"
    assert a.recovered == len(both.accepted)


# ---------------------------------------------------------------------- an entity made in a failed batch

# The writer's second commit fails (a full disk, by count); in a fresh broker that is the
# batch the test's first attach makes (checked: the failure must come after the attach).
ENTITY_FAULT = {"AMQPBROKER_STORE_FAULTS": "commit:DiskError@1*1"}
FAILED_COMMIT = r"store commit of \d+ batch\(es\) failed: disk full"


def failed_after(b: BrokerProcess, mark: int) -> None:
    """The injected failure came after `mark` (the log's length before the attach);
    durable messages are refused until a batch goes through again (`send_all`)."""
    deadline = time.monotonic() + 30
    while not re.search(FAILED_COMMIT, b.log_text()[mark:]):
        assert not re.search(FAILED_COMMIT, b.log_text()[:mark]), "the fault fired before the attach"
        assert time.monotonic() < deadline, "no failed commit after the attach"
        time.sleep(0.05)


def send_all(snd, count: int) -> list[int]:
    """`count` durable messages, each sent again while the store refuses it
    (`resource-limit-exceeded` just after the full disk); the refusals per message."""
    from proton import Message
    from proton.utils import SendException
    refused = []
    for i in range(count):
        tries = 0
        while True:
            try:
                snd.send(Message(body=i, durable=True))
                break
            except SendException:
                tries += 1
                assert tries < 100, f"message {i} refused {tries} times: the store did not recover"
                time.sleep(0.1)
        refused.append(tries)
    return refused


def test_a_queue_declared_in_a_failed_commit_keeps_every_message_accepted_into_it_after(broker_factory):
    """A producer's attach declares a new queue; the batch with its record fails.  The
    broker goes on with the queue in memory, so the messages it then accepts must
    not depend on that record: it is still written (store/batch.py removals_only).
    Before, all of them were gone after a restart (entries of a queue the store did
    not know)."""
    from tests.client import connect
    b = broker_factory(env=ENTITY_FAULT)
    q = uniq("declared")
    mark = len(b.log_text())
    conn = connect(b.url)
    snd = conn.create_sender(q)
    failed_after(b, mark)
    refused = send_all(snd, 50)
    conn.close()
    b.kill()
    b.start()
    assert sorted(body for body, _ in drain_bodies(b.url, q)) == list(range(50)), f"refused {refused}"


def test_a_durable_subscription_made_in_a_failed_commit_keeps_what_it_accepts_after(broker_factory):
    """The attach that makes a durable subscription is refused when its batch fails
    (`resource-limit-exceeded`), but the broker keeps the subscription; the client
    attaches again and finds it.  Every message then accepted for it is there after a
    restart (before: none, its record was never written)."""
    from proton.utils import LinkDetached
    from tests.client import connect
    from tests.e2e.jms_links import durable_consumer
    b = broker_factory(env=ENTITY_FAULT)
    topic, name = uniq("topic"), uniq("sub")
    mark = len(b.log_text())
    conn = connect(b.url, container_id="entity-app")
    with pytest.raises(LinkDetached, match="subscription could not be stored"):
        durable_consumer(conn, topic, name)
    failed_after(b, mark)
    conn.close()
    conn = connect(b.url, container_id="entity-app")
    durable_consumer(conn, topic, name).detach()
    pub = conn.create_sender(f"amq.topic/{topic}")
    send_all(pub, 50)
    conn.close()
    b.kill()
    b.start()
    conn = connect(b.url, container_id="entity-app")
    rcv = durable_consumer(conn, topic, name, credit=100)
    got = []
    while True:
        try:
            got.append(rcv.receive(timeout=3).body)
        except Exception:
            break
        rcv.accept()
    conn.close()
    assert sorted(got) == list(range(50))


def drain_bodies(url: str, address: str) -> list[tuple[object, int]]:
    from tests.client import connect
    conn = connect(url)
    rcv = conn.create_receiver(address, credit=100)
    out = []
    while True:
        try:
            msg = rcv.receive(timeout=3)
        except Exception:
            break
        out.append((msg.body, msg.delivery_count))
        rcv.accept()
    conn.close()
    return out
