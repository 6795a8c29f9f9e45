"""The cluster as management shows it (GET /api/cluster; docs/cluster.md).

Read through the ManagedBroker port's `cluster`: this node's router (an object with
`describe()`: amqpbroker/cluster/router.py), or None for a broker that is no node of
a cluster."""

from __future__ import annotations

from typing import Any


def cluster_view(managed: Any) -> dict:
    router = getattr(managed, "cluster", None)
    if router is None:
        return {"enabled": False}
    return {"enabled": True, **router.describe()}
