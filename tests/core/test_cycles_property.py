"""Random topologies (exchanges, bindings, dead-letter addresses, queue limits with
every overflow policy, drop-head included), random operations on them (rejects,
failed deliveries, moves, replays): every operation ends, and the messages it leaves
are bounded by what was there times the widest fan-out (core/moves.py, dead-letter
routing in core/broker.py).  Bounds are counts of steps and publishes, never time."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amqpbroker.core.addresses import AddressNotFound
from amqpbroker.core.broker import Broker, BrokerPolicy, QueueLimit
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.core.moves import Move, MoveRefused
from amqpbroker.core.queues import Outcome
from tests.core.helpers import RecordingConsumer, make_message

QUEUES = [f"q{i}" for i in range(4)]
EXCHANGES = [("fx", "fanout"), ("dx", "direct"), ("tx", "topic")]
KEYS = ["", "a", "b", "#"]
MAX_STEPS = 5_000


class Loop(AssertionError):
    pass


limits = st.one_of(st.none(), st.builds(QueueLimits, st.integers(1, 6), st.just(0),
                                        st.sampled_from(list(Overflow))))
binding = st.tuples(st.sampled_from([e for e, _ in EXCHANGES]), st.sampled_from(KEYS), st.sampled_from(QUEUES))
address = st.sampled_from(QUEUES + [e for e, _ in EXCHANGES] + ["fx/a", "dx/a", "dx/b", "tx/a", "tx/b"])
dead_letter_address = st.one_of(st.none(), address)
operation = st.one_of(
    st.tuples(st.just("reject"), st.sampled_from(QUEUES), st.integers(1, 10)),
    st.tuples(st.just("fail"), st.sampled_from(QUEUES), st.integers(1, 10)),
    st.tuples(st.just("move"), st.sampled_from(QUEUES), address),
    st.tuples(st.just("replay"), st.sampled_from(QUEUES), st.none()),
)
topology = st.fixed_dictionaries({
    "limits": st.lists(limits, min_size=len(QUEUES), max_size=len(QUEUES)),
    "bindings": st.lists(binding, max_size=10),
    "dla": dead_letter_address,
    "attempts": st.integers(0, 3),
    "messages": st.lists(st.tuples(address, st.sampled_from(["a", "b"])), min_size=1, max_size=25),
    "operations": st.lists(operation, min_size=1, max_size=6),
})


def build(t: dict) -> Broker:
    b = Broker(BrokerPolicy(dead_letter_address=t["dla"], max_delivery_attempts=t["attempts"],
                            auto_create_queues=False))
    for name, lim in zip(QUEUES, t["limits"]):
        b.declare_queue(name, limits=lim)
    for name, kind in EXCHANGES:
        b.declare_exchange(name, kind)
    for exchange, key, queue in set(t["bindings"]):
        b.bind(exchange, key, b.queues[queue])
    for i, (addr, subject) in enumerate(t["messages"]):
        try:
            b.publish(make_message(f"m{i}", subject=subject), b.resolve(addr))
        except QueueLimit:
            pass
    return b


def total(b: Broker) -> int:
    return sum(q.depth for q in b.queues.values())


def counted_publishes(b: Broker) -> list[int]:
    calls = [0, 10**9]      # [publishes so far, the bound of the running operation]
    publish = b.publish

    def counted(*a, **kw):
        calls[0] += 1
        if calls[0] > calls[1]:
            raise Loop(f"more than {calls[1]} publishes in one operation: a loop")
        return publish(*a, **kw)
    b.publish = counted
    return calls


def settle_all(q, outcome: Outcome, n: int, failed: bool = False) -> None:
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    for e in list(c.delivered):
        q.settle(e, outcome, delivery_failed=failed)
    q.remove_consumer(c, [e for e in c.delivered if e.consumer is c], failed=False)


def run(b: Broker, op: tuple) -> None:
    kind, queue, arg = op
    q = b.queues[queue]
    if kind == "reject":
        settle_all(q, Outcome.REJECTED, arg)
    elif kind == "fail":
        settle_all(q, Outcome.MODIFIED, arg, failed=True)
    else:
        try:
            move = Move(b, q, to=arg, replay=kind == "replay")
        except (MoveRefused, AddressNotFound):
            return
        steps = 0
        while not move.step():
            steps += 1
            if steps > MAX_STEPS:
                raise Loop(f"{kind} of {queue} did not end in {MAX_STEPS} steps: {move.report.view()}")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(topology)
def test_every_operation_ends_with_a_bounded_number_of_copies(t):
    b = build(t)
    calls = counted_publishes(b)
    fan_out = len(QUEUES)
    for op in t["operations"]:
        before = total(b)
        calls[0], calls[1] = 0, fan_out * (before + 1) + 10
        run(b, op)
        after = total(b)
        assert after <= max(before, 1) * fan_out, f"{op}: {before} messages became {after}"
