"""The python-qpid-proton this suite runs with can do TLS and SCRAM-SHA-256.  Built
without the Cyrus SASL headers (a wheel cached before libsasl2-dev was installed) it
silently cannot, and every SCRAM test fails for a reason none of them names;
scripts/setup.sh rebuilds it then (scripts/check_proton.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CHECK = Path(__file__).resolve().parent.parent / "scripts" / "check_proton.py"


def load_check():
    spec = importlib.util.spec_from_file_location("check_proton", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_proton_has_tls_and_scram():
    check = load_check()
    problems = [p for p in (check.tls_missing(), check.scram_missing()) if p]
    assert not problems, "; ".join(problems) + " (run scripts/setup.sh: it rebuilds python-qpid-proton)"
