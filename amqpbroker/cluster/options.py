"""What `[cluster]` says beyond the nodes: the pinned exchanges and the partitioned
destinations (the same on every node: configuration), read by a `--workers` node
(node.py) and a node of a cluster of machines (member.py) alike."""

from __future__ import annotations

from typing import Any

from ..config import Settings


def cluster_options(settings: Settings) -> tuple[frozenset[str], dict[str, int]]:
    """The pinned exchanges and the partitioned destinations (owning key → members) of
    `[cluster]` (the same on every node: they are configuration)."""
    cfg = settings.cluster
    if cfg is None:
        return frozenset(), {}
    from ..core.broker import BUILTIN_EXCHANGES
    from ..core.placement import partitioned_keys
    exchanges = {name: kind.value for name, kind in BUILTIN_EXCHANGES}
    exchanges.update({e.name: e.type for e in settings.exchanges})
    pinned = frozenset(cfg.pinned_exchanges)
    # Settings already refused what partitioned_keys refuses (config.py `_partitioned`).
    partitioned = partitioned_keys(((p.address, p.topic, p.members) for p in cfg.partitioned),
                                   exchanges=exchanges, pinned=pinned)
    return pinned, partitioned


def check_partitioned(slots: Any) -> None:
    owning = len(set(slots.owners))
    for key, members in slots.partitioned.items():
        if members > owning:
            raise ValueError(f"partitioned '{key}': {members} members but {owning} nodes own slots")
