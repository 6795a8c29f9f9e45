"""rhea (Node) over WebSocket for the WebSocket listener tests: the npm packages
pinned in tests/e2e/wsclient (rhea, ws), installed with `npm ci` on first use when
scripts/setup.sh has not done it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

WSCLIENT = Path(__file__).parent / "wsclient"


def ensure_node_modules() -> Path:
    if (WSCLIENT / "node_modules" / "rhea" / "dist" / "rhea.js").is_file() \
            and (WSCLIENT / "node_modules" / "ws").is_dir():
        return WSCLIENT
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.fail("node and npm are needed for the WebSocket tests (scripts/setup.sh installs them)")
    done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WSCLIENT,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"npm ci in {WSCLIENT} failed: {done.stderr}")
    return WSCLIENT


def rhea_round_trip(url: str, address: str, count: int, user: str | None = None,
                    password: str | None = None) -> dict:
    """Run client.js: `count` messages sent to `address` and received back."""
    ensure_node_modules()
    args = ["node", "client.js", url, address, str(count)] + ([user, password or ""] if user else [])
    done = subprocess.run(args, cwd=WSCLIENT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
