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


def test_more_workers_than_cores_start_with_a_warning_and_too_many_are_refused(tmp_path):
    """`--workers 65` on a 2-core machine started 65 workers without a word: now one
    warning line (allowed: a machine may be shared on purpose); beyond the 256 slots
    the start is refused before any worker starts.  The start ends by itself (the
    certificate is missing), after the warning."""
    from amqpbroker.cluster.workers import usable_cores
    config = tmp_path / "broker.toml"
    missing = tmp_path / "missing-cert.pem"
    config.write_text(f'[tls]\nport = 0\ncert_file = "{missing}"\nkey_file = "{missing}"\n')

    def serve(workers: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "amqpbroker.cli", "serve", "--workers", str(workers),
                               "--port", "0", "--data-dir", str(tmp_path / "data"), "--config", str(config)],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"))

    cores = usable_cores()
    crowded = serve(cores + 1)
    assert crowded.returncode == 2, crowded.stderr[-3000:]
    assert f"WARNING amqpbroker.cluster: --workers {cores + 1} on {cores} usable cores" in crowded.stderr
    refused = serve(257)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "amqpbroker: --workers 257: at most 256, the slots of the map (docs/cluster.md)"
    assert not (tmp_path / "data" / "node-256").exists()
