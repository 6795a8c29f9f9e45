"""A new slot map for a cluster of machines (`amqpbroker cluster remap`, docs/cluster.md
"Adding a machine"): which node owns each slot once nodes are added or weights change,
moving as few slots as can be.  Pure: cluster/remap.py reads and writes ZooKeeper, the
nodes move what the new map took from them behind the start gate (cluster/member.py).

Rules, each a refusal with its reason (RemapRefused):
* the slots stay as many as they are: a slot is a hash of an address modulo their
  number, so another number would move nearly every address;
* a node leaves the map only once it owns nothing (weight 0 in the current map, and
  emptied since: its queues go to their owners, its durable subscriptions moved when
  that map's gate opened); a node that still owns slots may hold what nobody else has.
  That it is empty is what it reported when it last stopped serving (`Holdings`,
  cluster/member.py): no report (killed, or never stopped since it served), one from
  under an older map, or one with messages or durable subscriptions is a refusal
  (`check_leaving`), unless the user says the machine is gone for good (`--force`).
  A node known never to have served (`never_served`: listed as not started when the
  map was written, and no record of its going live since) holds nothing: it may leave
  at once, weight and report aside (a machine added by mistake, or never set up);
* at least one node owns slots; a map equal to the current one is not written again
  (that would make every node wait at a gate for nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Iterable, Mapping, Sequence


class RemapRefused(ValueError):
    """The new map would lose or strand something, or means nothing new."""


@dataclass(frozen=True)
class Remap:
    nodes: tuple[str, ...]
    weights: dict[str, int]
    owners: tuple[str, ...]
    moves: dict[tuple[str, str], int]   # (from node, to node) → slots
    unstarted: tuple[str, ...] = ()     # nodes of the new map known never to have served

    @property
    def moved(self) -> int:
        return sum(self.moves.values())

    def as_map(self, pinned: Sequence[str]) -> dict:
        """The map znode's JSON, with its gate: the nodes serve no client under it until
        every node has moved out what it no longer owns (cluster/zkgate.py)."""
        return map_record(self.nodes, self.weights, self.owners, pinned, gate=True, unstarted=self.unstarted)


def map_record(nodes: Sequence[str], weights: Mapping[str, int], owners: Sequence[str], pinned: Iterable[str],
               *, gate: bool = False, unstarted: Iterable[str] = ()) -> dict:
    """The slot map znode's JSON (cluster/membership.py): as the first node makes it from
    its configuration (every node `unstarted`), and as a remap writes it (`gate`)."""
    record = {"nodes": list(nodes), "weights": dict(weights), "slots": len(owners), "owners": list(owners),
              "pinned": sorted(pinned), "unstarted": list(unstarted)}
    if gate:
        record["gate"] = True
    return record


def targets(nodes: Sequence[str], weights: Mapping[str, int], slots: int) -> dict[str, int]:
    """Slots per node in proportion to its weight (default 1): the whole parts first,
    then one more to each of the largest remainders (ties in the nodes' order)."""
    w = {n: max(0, weights.get(n, 1)) for n in nodes}
    total = sum(w.values())
    if total == 0:
        raise RemapRefused("at least one node must own slots (every weight is 0)")
    counts = {n: slots * w[n] // total for n in nodes}
    left = slots - sum(counts.values())
    by_remainder = sorted(nodes, key=lambda n: (-(slots * w[n] % total), nodes.index(n)))
    for n in by_remainder[:left]:
        counts[n] += 1
    return counts


def rebalance(owners: Sequence[str], nodes: Sequence[str], weights: Mapping[str, int]) -> tuple[str, ...]:
    """Each slot stays with its owner while that owner is in `nodes` and under its
    target; the others go, in slot order, to the first node (in `nodes` order) still
    under its own.  So only the slots that must move do."""
    want = targets(nodes, weights, len(owners))
    held = dict.fromkeys(nodes, 0)
    new: list[str | None] = []
    for owner in owners:
        keep = owner in want and held[owner] < want[owner]
        new.append(owner if keep else None)
        if keep:
            held[owner] += 1
    hungry = iter(n for n in nodes for _ in range(want[n] - held[n]))
    return tuple(owner if owner is not None else next(hungry) for owner in new)


def never_served(current: Mapping, served: Iterable[str]) -> frozenset[str]:
    """The nodes of the current map (its znode's JSON) known never to have served:
    listed `unstarted` when the map was written (a map of an older version lists none)
    and with no record of going live since (`served`: cluster/membership.py writes one
    before a node first takes its live znode).  Nothing was ever placed on such a node:
    a gate waits for every node of its map, and moves wait for their target to be live."""
    return frozenset(current.get("unstarted", ())) - frozenset(served)


def plan_remap(current: Mapping, nodes: Sequence[str], weights: Mapping[str, int], *,
               unserved: AbstractSet[str] = frozenset()) -> Remap:
    """The new map from the current map znode's JSON and the wanted nodes and weights;
    `unserved`: the current map's nodes known never to have served (`never_served`)."""
    nodes = tuple(nodes)
    if not nodes or len(set(nodes)) != len(nodes):
        raise RemapRefused("the nodes must be named, each once")
    unknown = sorted(set(weights) - set(nodes))
    if unknown:
        raise RemapRefused(f"weights name nodes that are not in nodes: {unknown}")
    old_owners = tuple(current["owners"])
    old_weights = current.get("weights", {})
    leaving = [n for n in current["nodes"] if n not in nodes]
    owning = sorted(n for n in leaving if n not in unserved and (n in old_owners or old_weights.get(n, 1) != 0))
    if owning:
        raise RemapRefused(f"node(s) {', '.join(owning)} still own slots: give them weight 0 first (a remap), "
                           f"let them empty, then leave them out")
    full = {n: weights.get(n, 1) for n in nodes}
    if list(nodes) == list(current["nodes"]) and full == {n: old_weights.get(n, 1) for n in nodes}:
        raise RemapRefused("the slot map has these nodes and weights already: nothing to write")
    owners = rebalance(old_owners, nodes, full)
    moves: dict[tuple[str, str], int] = {}
    for old, new in zip(old_owners, owners):
        if old != new:
            moves[(old, new)] = moves.get((old, new), 0) + 1
    unstarted = tuple(n for n in nodes if n not in current["nodes"] or n in unserved)
    return Remap(nodes, full, owners, moves, unstarted)


@dataclass(frozen=True)
class Holdings:
    """What a node held when it last stopped serving: its report in ZooKeeper
    (cluster/member.py writes it at a clean stop, deletes it when it goes live)."""
    epoch: int                  # the slot map it served under
    messages: int               # in its durable queues and durable subscriptions
    subscriptions: int          # durable subscriptions
    queues: tuple[str, ...]     # the first few durable queues (not subscriptions') that were not empty

    def as_record(self) -> dict:
        return {"epoch": self.epoch, "messages": self.messages, "subscriptions": self.subscriptions,
                "queues": list(self.queues)}

    @classmethod
    def from_record(cls, record: Mapping) -> "Holdings":
        return cls(int(record["epoch"]), int(record["messages"]), int(record["subscriptions"]),
                   tuple(str(q) for q in record.get("queues", ())))


def check_leaving(leaving: Sequence[str], reports: Mapping[str, Holdings | None], epoch: int,
                  unserved: AbstractSet[str] = frozenset()) -> None:
    """RemapRefused unless every node that leaves the map reported, at its last stop
    under the current map (`epoch`), that it held nothing: a node's queues go to their
    owners only while it runs, so one left out before that would strand them.  A node
    that never served (`unserved`) holds nothing and needs no report."""
    why = []
    for node in leaving:
        if node in unserved:
            continue
        held = reports.get(node)
        if held is None:
            why.append(f"node {node} has not reported what it holds (it was killed, or has not stopped since "
                       f"it last served)")
        elif held.epoch != epoch:
            why.append(f"node {node} last stopped under slot map epoch {held.epoch}, not the current {epoch} "
                       f"(it moves out what it holds only under the map that took its slots)")
        elif held.messages or held.subscriptions:
            queues = f" (queues not empty: {', '.join(held.queues)})" if held.queues else ""
            why.append(f"node {node} held {held.messages} message(s) and {held.subscriptions} durable "
                       f"subscription(s) when it stopped{queues}")
    if why:
        raise RemapRefused("; ".join(why) + ": start it under the current map until its queues have gone to "
                           "their owners, stop it, and remap again (or --force if its machine is gone for good: "
                           "what it holds is lost)")


def describe(remap: Remap, epoch: int) -> str:
    """What a remap does, in one paragraph (the command prints it)."""
    count = {n: remap.owners.count(n) for n in remap.nodes}
    lines = [f"slot map epoch {epoch} -> {epoch + 1}: {remap.moved} of {len(remap.owners)} slots change owner"]
    lines += [f"  {a} -> {b}: {k} slots" for (a, b), k in sorted(remap.moves.items())]
    lines.append("  owned: " + ", ".join(f"{n} {count[n]}" for n in remap.nodes))
    return "\n".join(lines)
