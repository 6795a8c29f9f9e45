"""`amqpbroker` command line: configuration errors, environment overrides, --port 0,
signals, hash-password."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest
from proton import Endpoint

from tests.client import connect
from tests.e2e.helpers_conn import CLI, RawClient, run_cli

pytestmark = pytest.mark.e2e


def _serve(tmp_path, config: str | None, env: dict | None = None, extra: list[str] | None = None):
    args = ["serve", "--data-dir", str(tmp_path / "data")]
    if config is None or not re.search(r"^port\s*=", config, re.M):
        args += ["--port", "0"]             # --port would override (and hide) a bad TOML port
    if config is not None:
        cfg = tmp_path / "broker.toml"
        cfg.write_text(config)
        args += ["--config", str(cfg)]
    # A valid configuration would start serving and never return: the timeout
    # turns that into a test failure instead of a hang.
    return run_cli(args + (extra or []), env=env, timeout=20)


def _one_clear_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


# ---------------------------------------------------------------------- config errors

@pytest.mark.parametrize("config,field", [
    ('port = "abc"\n', "port"),
    ("[limits]\nmax_frame_size = 10\n", "limits.max_frame_size"),
    ("[limits]\nidle_timeout = -1\n", "limits.idle_timeout"),
    ('client_id_policy = "sometimes"\n', "client_id_policy"),
    ("prot = 5672\n", "prot"),
], ids=["port-not-int", "frame-size-too-small", "negative-idle-timeout", "bad-enum", "unknown-key"])
def test_invalid_config_field_exits_2_naming_it(tmp_path, config, field):
    out = _serve(tmp_path, config)
    assert out.returncode == 2, out.stderr
    line = _one_clear_line(out.stderr)
    assert f"'{field}'" in line, line
    assert line.startswith("amqpbroker:")


def test_toml_syntax_error_exits_2(tmp_path):
    out = _serve(tmp_path, "port = = 1\n[limits\n")
    assert out.returncode == 2, out.stderr
    line = _one_clear_line(out.stderr)
    assert "broker.toml" in line


def test_missing_config_file_exits_2(tmp_path):
    out = run_cli(["serve", "--port", "0", "--config", str(tmp_path / "nope.toml")], timeout=20)
    assert out.returncode == 2
    line = _one_clear_line(out.stderr)
    assert "nope.toml" in line and "does not exist" in line


def test_invalid_env_var_exits_2_naming_the_field(tmp_path):
    out = _serve(tmp_path, None, env={"AMQPBROKER_LIMITS__MAX_FRAME_SIZE": "10"})
    assert out.returncode == 2, out.stderr
    line = _one_clear_line(out.stderr)
    assert "'limits.max_frame_size'" in line, line


def test_env_vars_override_config_file(broker_factory):
    b = broker_factory(
        'container_id = "from-toml"\n[limits]\nmax_frame_size = 4096\nmax_connections = 50\n',
        env={"AMQPBROKER_CONTAINER_ID": "from-env", "AMQPBROKER_LIMITS__MAX_FRAME_SIZE": "8192"})
    c = RawClient(b.host, b.port, container_id="env-check").wait_open()
    try:
        assert c.conn.remote_container == "from-env"
        assert c.transport.remote_max_frame_size == 8192
    finally:
        c.close()


def test_config_file_values_apply_without_env(broker_factory):
    b = broker_factory('container_id = "from-toml"\n[limits]\nmax_frame_size = 4096\n')
    c = RawClient(b.host, b.port, container_id="toml-check").wait_open()
    try:
        assert c.conn.remote_container == "from-toml"
        assert c.transport.remote_max_frame_size == 4096
    finally:
        c.close()


# ---------------------------------------------------------------------- port 0, signals

def test_port_zero_logs_the_chosen_port(broker):
    line = broker.wait_for_log(r"amqp listening on")
    m = re.search(r"amqp listening on 127\.0\.0\.1:(\d+)", line)
    assert m and int(m.group(1)) == broker.port and broker.port != 0
    conn = connect(broker.url, container_id="port-zero")
    conn.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_closes_clients_with_forced_and_exits_0(broker_factory, sig):
    b = broker_factory()
    clients = [RawClient(b.host, b.port, container_id=f"sig-{i}").wait_open() for i in range(2)]
    try:
        for c in clients:
            ssn = c.session()
            c.receiver(ssn, "sig-q", "sig-rcv")
        b.proc.send_signal(sig)
        for c in clients:
            c.wait(lambda c=c: c.conn.state & Endpoint.REMOTE_CLOSED, timeout=10, what="forced close")
            cond = c.conn.remote_condition
            assert cond is not None and cond.name == "amqp:connection:forced", cond
            c.conn.close()                     # answer the Close, as a client should
            c.wait(lambda c=c: c.socket_closed, timeout=10, what="socket close")
        assert b.proc.wait(timeout=10) == 0
    finally:
        for c in clients:
            c.abandon()
    b.wait_for_log(r"shutting down")
    b.wait_for_log(r"broker stopped")
    assert "Traceback" not in b.log_text()


def test_sigterm_with_unresponsive_client_still_exits_0(broker_factory):
    b = broker_factory()
    c = RawClient(b.host, b.port, container_id="sig-deaf").wait_open()
    try:
        b.proc.send_signal(signal.SIGTERM)
        # never answers the Close: the broker gives up after its grace period
        assert b.proc.wait(timeout=15) == 0
    finally:
        c.abandon()
    b.wait_for_log(r"broker stopped")


# ---------------------------------------------------------------------- hash-password

def test_hash_password_prints_salted_scram_hash(broker_factory):
    first, second = run_cli(["hash-password", "s3cret"]), run_cli(["hash-password", "s3cret"])
    assert first.returncode == 0 and second.returncode == 0
    h1, h2 = first.stdout.strip(), second.stdout.strip()
    assert re.fullmatch(r"scram-sha-256\$\d+\$[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+", h1), h1
    assert h1 != h2, "hashes are not salted"
    assert "s3cret" not in h1
    b = broker_factory(f'allow_anonymous = false\n[users.carol]\npassword = "{h1}"\n')
    for mech in ("PLAIN", "SCRAM-SHA-256"):
        conn = connect(b.url, container_id=f"carol-{mech}", user="carol", password="s3cret",
                       allowed_mechs=mech, allow_insecure_mechs=True)
        conn.close()
        assert "user=carol" in b.wait_for_log(rf"connection open: .*container=carol-{mech} ")


def test_hash_password_prompts_when_no_argument():
    from amqpbroker.security.users import UserStore
    proc = subprocess.run(CLI + ["hash-password"], input="typed-secret\n", capture_output=True,
                          text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    digest = proc.stdout.strip()
    assert digest.startswith("scram-sha-256$") and "\n" not in digest
    store = UserStore({"dave": digest})
    assert store.verify_plain("dave", "typed-secret")
    assert not store.verify_plain("dave", "typed-secreT")
