"""Bench smoke: the latency benches run and print their figures (a short run of each).

Nothing here is timed or compared: figures come from the benches themselves
(bench/README.md), on a machine that may be busy.  What is checked is that the
project's bench (bench/run.py's latency scenario, with loadgen's opening burst) and
the independent tool (bench/amqp-bench, run by bench/rates.py beside loadgen) both
run against this broker and the Proton C example broker, and print a figure for
each; and that bench/sync_floor.py prints a sync-send figure for each of its
subjects and the bound it derives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "bench" / "build"
NUMBER = r"\d[\d,]*(?:\.\d+)?"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tools():
    """bench/build/{loadgen,amqp-bench,cbroker}, built when missing (bench/build.sh:
    gcc and libqpid-proton11-dev(-examples), which scripts/setup.sh installs)."""
    if not all((BUILD / t).exists() for t in ("loadgen", "amqp-bench", "cbroker")):
        built = subprocess.run(["bash", str(REPO / "bench" / "build.sh")], capture_output=True, text=True,
                               timeout=300)
        assert built.returncode == 0, built.stdout + built.stderr
    return BUILD


def bench(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_run_py_latency_scenario_runs_against_both_brokers(tools):
    out = bench("bench/run.py", "--brokers", "amqpbroker,cbroker", "--scenarios", "latency",
                "--latency-seconds", "1", "--warmup", "0", "--timeout", "60", "--plain")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\S*\s*\|\s*(p99 ms|max ms)\s*\|.*$", out, re.M)}
    for metric in ("p99 ms", "max ms"):
        cells = [c.strip() for c in rows[metric].split("|")[2:4]]
        assert all(re.fullmatch(NUMBER, c) for c in cells), rows[metric]
    assert "error" not in out and "failed to start" not in out, out


def test_rates_py_runs_amqp_bench_and_loadgen_against_both_brokers(tools):
    out = bench("bench/rates.py", "--rates", "1000", "--repeat", "1", "--messages", "500", "--warmup", "500",
                "--timeout", "60")
    for tool in ("amqp-bench", "loadgen"):
        for broker in ("amqpbroker", "C example"):
            line = re.search(rf"^\s*1000 {tool}\s+{broker}\s+({NUMBER})\s+({NUMBER})\s+({NUMBER}).*$", out, re.M)
            assert line, f"no {tool} figures for {broker}:\n{out}"
            assert "failed" not in line.group(0), line.group(0)
    assert re.search(rf"broker CPU per message at 1,000 msgs/s \(amqp-bench runs\): {NUMBER} µs", out), out


def test_sync_floor_py_measures_every_subject_against_fsync(tools):
    out = bench("bench/sync_floor.py", "--messages", "300", "--reps", "1", "--fsyncs", "50", "--timeout", "60")
    for subject in ("amqpbroker, not durable", "amqpbroker", "sink", "sink + fdatasync", "C example broker"):
        row = re.search(rf"^  {re.escape(subject)}\s+({NUMBER})\s+({NUMBER}) us\s+({NUMBER})$", out, re.M)
        assert row, f"no figures for {subject}:\n{out}"
        assert float(row.group(1).replace(",", "")) > 0
    assert re.search(rf"best a commit in the broker's own process could do .*: {NUMBER} msgs/s = {NUMBER} x 1/fsync",
                     out), out
