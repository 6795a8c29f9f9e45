"""`amqpbroker cluster remap` on a configuration it cannot use: one line naming the
problem and exit 2, before any ZooKeeper is asked (cluster/cli.py `remap_main`)."""

from __future__ import annotations

import argparse
import io

import pytest

from amqpbroker.cluster.cli import remap_main

CLUSTER = '[cluster]\nzookeeper = "127.0.0.1:1"\nname = "c"\nnode_id = "a"\nnodes = ["a"]\nsecret = "s-0123456789abcdef"\n'


@pytest.mark.parametrize("text, said", [
    (CLUSTER + "weights = { b = 0 }\n", "weights name nodes that are not in nodes: ['b']"),   # valid TOML
    (CLUSTER + "wieghts = { a = 1 }\n", "wieghts"),                                            # unknown key
    ("[cluster\n", "c.toml"),                                                                  # not TOML
    ("", "the configuration has no [cluster] with zookeeper"),
])
def test_a_configuration_remap_cannot_use_is_one_line_and_exit_2(tmp_path, capsys, text, said):
    path = tmp_path / "c.toml"
    path.write_text(text)
    code = remap_main(argparse.Namespace(config=str(path), dry_run=True, force=False), io.StringIO())
    err = capsys.readouterr().err
    assert code == 2 and said in err, err
    assert "Traceback" not in err and all(line.startswith("amqpbroker cluster remap: ") for line in err.splitlines())
