"""`serve --workers N` options (cluster/workers.py) and the worker's settings (cluster/node.py)."""

from __future__ import annotations

import pytest

from amqpbroker.cli import _without_workers
from amqpbroker.cluster.node import WorkerSpec, worker_settings
from amqpbroker.cluster.workers import crowding, parse_weights, reserve_port, worker_count
from amqpbroker.config import Settings


def test_worker_count_auto_is_the_cores_this_process_may_use():
    assert worker_count("auto") >= 1
    assert worker_count("3") == 3
    with pytest.raises(ValueError):
        worker_count("0")


@pytest.mark.parametrize("value", ["256", "257", "65536", " 3", "+3", "3.0", "²", "٣", "", "three"])
def test_a_worker_count_is_ascii_digits_and_at_most_one_per_slot(value):
    if value == "256":
        assert worker_count(value) == 256
        return
    with pytest.raises(ValueError) as refused:
        worker_count(value)
    said = str(refused.value)
    assert ("at most 256, the slots of the map" in said) if value.isascii() and value.isdigit() \
        else ("--workers needs a number of workers or auto, not" in said)


@pytest.mark.parametrize("count, cores, warned", [(1, 2, False), (2, 2, False), (3, 2, True), (65, 2, True),
                                                  (8, 8, False)])
def test_more_workers_than_cores_is_allowed_with_a_warning(count, cores, warned):
    said = crowding(count, cores)
    assert (said is not None) == warned
    if warned:
        assert said.startswith(f"--workers {count} on {cores} usable cores")


def test_weights_default_even_and_zero_means_forward_only():
    nodes = ["n0", "n1", "n2"]
    assert parse_weights(None, nodes) == {"n0": 1, "n1": 1, "n2": 1}
    assert parse_weights("0,1,2", nodes) == {"n0": 0, "n1": 1, "n2": 2}
    for bad in ("1,1", "0,0,0", "1,-1,1"):
        with pytest.raises(ValueError):
            parse_weights(bad, nodes)


def test_a_worker_gets_the_serve_line_without_the_supervisors_options():
    argv = ["serve", "--workers", "3", "--port", "0", "--worker-weights=0,1,1", "--data-dir", "d"]
    assert _without_workers(argv) == ["serve", "--port", "0", "--data-dir", "d"]


def test_worker_settings_own_data_dir_shared_port_own_management_port(tmp_path):
    spec = WorkerSpec(nodes=["n0", "n1"], weights={"n0": 1, "n1": 1}, sockets={}, secret="00", port=5999)
    base = Settings(data_dir=tmp_path, port=0, management={"port": 8161})
    w1 = worker_settings(base, spec, 1)
    assert (w1.data_dir, w1.port, w1.management.port) == (tmp_path / "node-1", 5999, 8162)
    free = worker_settings(Settings(data_dir=tmp_path, management={"port": 0}), spec, 1)
    assert free.management.port == 0


def test_the_spec_file_is_private(tmp_path):
    spec = WorkerSpec(nodes=["n0"], weights={"n0": 1}, sockets={"n0": "unix:@x"}, secret="ab" * 32, port=1)
    path = tmp_path / "workers.json"
    spec.write(path)
    assert path.stat().st_mode & 0o077 == 0
    assert WorkerSpec.read(path) == spec


def test_the_reserved_port_is_shared_by_listeners_with_so_reuseport():
    import socket
    holder = reserve_port("127.0.0.1", 0)
    port = holder.getsockname()[1]
    a = socket.socket()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    a.bind(("127.0.0.1", port))
    a.listen()
    assert a.getsockname()[1] == port
    a.close()
    holder.close()


def test_workers_with_an_ha_section_are_refused(tmp_path, capsys):
    """The workers would each run a plain broker: [ha] would be dropped without a word."""
    from amqpbroker.cli import main
    config = tmp_path / "broker.toml"
    config.write_text('[ha]\nrole = "primary"\nzookeeper = "127.0.0.1:1"\nsecret = "0123456789abcdef0123"\n')
    assert main(["serve", "--config", str(config), "--workers", "2", "--data-dir", str(tmp_path / "d")]) == 2
    assert "--workers and [ha] do not go together" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["--workers", "abc"], "--workers needs a number of workers or auto, not 'abc'"),
    (["--workers", "0"], "--workers must be at least 1"),
    # Before: a traceback from the supervisor (exit 1), or the weights dropped without a word.
    (["--workers", "2", "--worker-weights", "1"], "--worker-weights needs 2 non-negative whole numbers"),
    (["--workers", "2", "--worker-weights", "0,0"], "not all 0 (e.g. 0,1), not '0,0'"),
    (["--workers", "3", "--worker-weights", "a,b,c"], "not 'a,b,c'"),
    (["--worker-weights", "0,1"], "--worker-weights goes with --workers N"),
    (["--workers", "1", "--worker-weights=1"], "--worker-weights goes with --workers N"),
])
def test_workers_options_that_cannot_be_meant_exit_2_with_one_line(tmp_path, capsys, args, said):
    from amqpbroker.cli import main
    data = tmp_path / "d"
    assert main(["serve", "--port", "0", "--data-dir", str(data)] + args) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not data.exists(), "nothing was started"


@pytest.mark.parametrize("args", [["--workers", "2"], ["--workers", "3", "--worker-weights", "0,1,1"]])
def test_more_members_than_workers_that_own_slots_is_refused_once_not_by_every_worker(tmp_path, capsys, args):
    """Each worker refused it (exit 2) and the supervisor started it again, for ever."""
    from amqpbroker.cli import main
    config = tmp_path / "broker.toml"
    config.write_text('[cluster]\npartitioned = [{address = "o", members = 3}]\n')
    data = tmp_path / "d"
    assert main(["serve", "--port", "0", "--config", str(config), "--data-dir", str(data)] + args) == 2
    err = capsys.readouterr().err
    assert "partitioned 'o': 3 members but 2 nodes own slots" in err and len(err.strip().splitlines()) == 1, err
    assert not data.exists()
