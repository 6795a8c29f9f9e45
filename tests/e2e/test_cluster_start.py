"""End to end: a `serve --workers N` start that cannot succeed ends, as one broker's
does, instead of starting its workers again for ever (cluster/workers.py
`START_REFUSALS`).

How it could fail: a file every worker needs is missing (here the TLS certificate:
each worker opens its listeners once the start gate is open, so the gate does not
see it); each worker exits 2 with its line, the supervisor starts it again, and the
command serves nothing and never exits.  Checked: the command exits 2, each worker's
line names the section, the key and the path, and the supervisor says why it stopped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_workers_that_cannot_start_end_the_start_with_exit_2_and_the_reason(tmp_path):
    config = tmp_path / "broker.toml"
    missing = tmp_path / "missing-cert.pem"
    config.write_text(f'[tls]\nport = 0\ncert_file = "{missing}"\nkey_file = "{missing}"\n')
    done = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "serve", "--workers", "2", "--port", "0",
                           "--data-dir", str(tmp_path / "data"), "--config", str(config)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"[tls]: no such file: cert_file {missing}" in done.stderr
    assert "cannot start (exit 2, 3 times, never serving yet); stopping every worker" in done.stderr
    assert "Traceback" not in done.stderr
