"""ha/state.py: the node's file and the activation a store holds; and that a broker
without [ha] loads nothing of HA."""

import subprocess
import sys

import lmdb
import pytest

from amqpbroker.config import ConfigError, load_settings
from amqpbroker.ha.state import ACTIVATION_KEY, NodeState, stored_activation


def test_node_state_keeps_its_id_and_completeness(tmp_path):
    s = NodeState.load(tmp_path, None)
    assert s.complete is True
    s.set_complete(False)
    again = NodeState.load(tmp_path, None)
    assert again.node_id == s.node_id and again.complete is False
    assert NodeState.load(tmp_path, "fixed").node_id == "fixed"


def test_stored_activation(tmp_path):
    assert stored_activation(tmp_path / "none") == 0
    env = lmdb.open(str(tmp_path), max_dbs=16)
    db = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(ACTIVATION_KEY, b"7", db=db)
    env.close()
    assert stored_activation(tmp_path) == 7


def test_ha_settings_need_a_secret(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('[ha]\nzookeeper = "127.0.0.1:2181"\nsecret = "short"\n')
    with pytest.raises(ConfigError, match="ha.secret"):
        load_settings(cfg)
    cfg.write_text('[ha]\nzookeeper = "127.0.0.1:2181"\nsecret = "0123456789abcdef"\nrole = "backup"\n')
    assert load_settings(cfg).ha.role == "backup"
    cfg.write_text("")
    assert load_settings(cfg).ha is None


def test_a_broker_without_ha_loads_nothing_of_it():
    code = ("import sys, amqpbroker.cli, amqpbroker.server.app, amqpbroker.management.service\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kazoo', 'amqpbroker.ha'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_node_state_keeps_the_store_position(tmp_path):
    s = NodeState.load(tmp_path, "n")
    assert (s.lineage, s.position) == (None, -1)
    s.set_position("lineage-1", 41)
    again = NodeState.load(tmp_path, None)
    assert (again.lineage, again.position, again.node_id) == ("lineage-1", 41, "n")
    again.set_position(None, -1)          # a copy is about to replace the store
    assert NodeState.load(tmp_path, None).lineage is None


def test_the_default_replication_port_is_no_other_listener_s(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('[ha]\nzookeeper = "127.0.0.1:2181"\nsecret = "0123456789abcdef"\n')
    s = load_settings(cfg)
    assert s.ha.replication_port not in (s.port, 5671, 5673, s.management.port)
    assert (s.ha.zookeeper_session_timeout, s.ha.backup_timeout) == (3.0, 2.0)
