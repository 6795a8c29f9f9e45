"""A cluster node that is an HA pair: the settings of its two brokers (cluster/pair.py)."""

from __future__ import annotations

from amqpbroker.cluster.pair import pair_settings
from amqpbroker.config import load_settings

CLUSTER = """
[cluster]
zookeeper = "127.0.0.1:2181"
name = "orders"
node_id = "a"
nodes = ["a", "b"]
secret = "a-long-enough-secret"
"""


def broker(role: str, listen_port: int, ha_extra: str = "") -> str:
    return (f'[ha]\nrole = "{role}"\nzookeeper = "127.0.0.1:2181"\nsecret = "pair-secret-0123456789"\n'
            + ha_extra + CLUSTER + f"listen_port = {listen_port}\n")


def test_both_brokers_of_a_pair_share_the_node_id():
    primary = load_settings(text=broker("primary", 5680))
    backup = load_settings(text=broker("backup", 5681))
    assert primary.cluster.node_id == backup.cluster.node_id == "a"
    assert (primary.ha.role, backup.ha.role) == ("primary", "backup")


def test_the_pairs_name_defaults_to_the_cluster_and_node():
    settings = pair_settings(load_settings(text=broker("primary", 5680)))
    assert settings.ha.cluster == "orders.a"
    other = load_settings(text=broker("primary", 5680).replace('node_id = "a"', 'node_id = "b"'))
    assert pair_settings(other).ha.cluster == "orders.b"   # two nodes' pairs never share a lock


def test_a_pairs_name_set_in_the_configuration_is_kept():
    settings = pair_settings(load_settings(text=broker("primary", 5680, 'cluster = "default"\n')))
    assert settings.ha.cluster == "default"
    settings = pair_settings(load_settings(text=broker("primary", 5680, 'cluster = "pair-a"\n')))
    assert settings.ha.cluster == "pair-a"
