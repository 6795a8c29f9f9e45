"""The cluster as management shows it (GET /api/cluster, /metrics; docs/cluster.md).

Read through the ManagedBroker port's `cluster`: this node's router (an object with
`describe()`: amqpbroker/cluster/router.py), or None for a broker that is no node of
a cluster."""

from __future__ import annotations

from typing import Any

ZK_STATES = ("CONNECTED", "SUSPENDED", "LOST")


def cluster_view(managed: Any) -> dict:
    router = getattr(managed, "cluster", None)
    if router is None:
        return {"enabled": False}
    return {"enabled": True, **router.describe()}


def cluster_figures(managed: Any) -> dict[str, tuple[str, str, float]]:
    """This node's gauges and counters (Prometheus); none for a broker that is no
    node of a cluster.  Each node has its own /metrics: sum them across nodes."""
    router = getattr(managed, "cluster", None)
    if router is None:
        return {}
    view = router.describe()
    fwd = view["forwarded"]
    out = {
        "amqpbroker_cluster_serving": (
            "gauge", "1 while this node serves its slots (0: its ZooKeeper session is in doubt or lost)",
            int(view["serving"])),
        "amqpbroker_cluster_slots_owned": ("gauge", "Slots of the map this node owns", view["slots_owned"]),
        "amqpbroker_cluster_map_epoch": ("gauge", "The slot map's epoch (ZooKeeper's version of it)", view["epoch"]),
        "amqpbroker_cluster_nodes_live": ("gauge", "Nodes of the map that are live, as this node sees them",
                                          sum(1 for n in view["nodes"] if n["live"])),
        "amqpbroker_cluster_nodes": ("gauge", "Nodes of the map", len(view["nodes"])),
        "amqpbroker_cluster_forwarded_links": (
            "gauge", "Links on this node's connections to other nodes for its clients (forwarded links, "
                     "partition members, relays)", fwd["links"]),
        "amqpbroker_cluster_forwarded_links_total": (
            "counter", "Client links forwarded (or spread over members) to other nodes", fwd["links_total"]),
        "amqpbroker_cluster_deliveries_waiting": (
            "gauge", "Client messages sent to the nodes that own them and not answered yet",
            fwd["waiting_on_owners"]),
        "amqpbroker_cluster_deliveries_unsettled_at_clients": (
            "gauge", "Deliveries from other nodes passed on to this node's clients and not settled by them",
            fwd["unsettled_at_clients"]),
        "amqpbroker_cluster_connections_out": (
            "gauge", "Connections this node holds to other nodes for its clients", fwd["connections"]),
        "amqpbroker_cluster_connections_in": (
            "gauge", "Connections other nodes hold to this one for their clients", view["inter_node_connections_in"]),
    }
    handoff = view.get("handoff")
    if handoff is not None:   # serve --workers (cluster/handoff.py)
        out["amqpbroker_cluster_connections_handed_off_total"] = (
            "counter", "Client connections this node handed, socket and all, to their first link's owner",
            handoff["handed_total"])
        out["amqpbroker_cluster_connections_adopted_total"] = (
            "counter", "Client connections other nodes handed to this one", handoff["adopted_total"])
    zk = view.get("zookeeper")
    if zk is not None:
        for state in ZK_STATES:
            out[f"amqpbroker_cluster_zookeeper_{state.lower()}"] = (
                "gauge", f"1 while this node's ZooKeeper session is {state}", int(zk["session"] == state))
    return out
