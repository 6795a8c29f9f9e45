"""The HA pair as management shows it (GET /api/ha, /metrics; docs/ha.md).

Read through the ManagedBroker port's `ha`: the pair's node (an object with
`describe()`), or None for a broker that runs alone."""

from __future__ import annotations

from typing import Any

PEER_STATES = ("absent", "syncing", "catching", "in-sync", "lost", "alone")


def ha_view(managed: Any) -> dict:
    node = getattr(managed, "ha", None)
    if node is None:
        return {"enabled": False}
    return node.describe()


def ha_figures(managed: Any) -> dict[str, tuple[str, str, float]]:
    """Gauges of the pair; none for a broker that runs alone."""
    node = getattr(managed, "ha", None)
    if node is None:
        return {}
    view = node.describe()
    out = {
        "amqpbroker_ha_live": ("gauge", "1 while this broker is the pair's live broker", int(view["status"] == "live")),
        "amqpbroker_ha_activation": ("gauge", "The activation sequence this broker went live with (or raised to)",
                                     view["activation"]),
        "amqpbroker_ha_zookeeper_connected": ("gauge", "1 while the ZooKeeper session is connected",
                                              int(view["zookeeper"]["session"] == "CONNECTED")),
    }
    rep = view.get("replication")
    if rep is not None:
        out["amqpbroker_ha_backup_in_sync"] = (
            "gauge", "1 while the backup holds everything acknowledged (it may take over)",
            int(rep["peer_state"] == "in-sync"))
        out["amqpbroker_ha_replication_lag_batches"] = (
            "gauge", "Store batches sent to the backup and not acknowledged yet", rep["lag_batches"])
        out["amqpbroker_ha_replication_lag_seconds"] = (
            "gauge", "Age of the oldest store batch the backup has not acknowledged", rep["lag_seconds"])
        out["amqpbroker_ha_alone_total"] = (
            "counter", "Times the live broker gave its backup up and went on alone", rep["alone_total"])
        out["amqpbroker_ha_acknowledgements_held"] = (
            "gauge", "1 while nothing is acknowledged because the ZooKeeper session is in doubt", int(rep["held"]))
    return out
