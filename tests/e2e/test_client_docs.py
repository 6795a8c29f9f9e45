"""The client snippets of docs/clients.md, run as written against a real broker
(only the port is changed): python-qpid-proton and rhea on Node.js here, rhea in
headless Chromium over WebSocket too.  Every snippet marked `<!-- snippet: NAME -->`
must have a runner below, so a new snippet cannot go untested."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.websocket_support import ensure_node_modules

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.S)


def snippets() -> dict[str, str]:
    return {name: code for name, _, code in SNIPPET.findall(DOC.read_text())}


def at(code: str, broker) -> str:
    """The snippet against this broker: its AMQP (and WebSocket) port for the documented ones."""
    code = code.replace("127.0.0.1:5672", f"127.0.0.1:{broker.port}").replace("port: 5672", f"port: {broker.port}")
    if "ws" in broker.ports:
        code = code.replace("ws://127.0.0.1:5673/", f"ws://127.0.0.1:{broker.ports['ws']}/")
    return code


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_node(code: str, tmp_path: Path) -> str:
    modules = ensure_node_modules() / "node_modules"
    script = tmp_path / "snippet.js"
    script.write_text(code)
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NODE_PATH": str(modules)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def subscription(broker, name: str) -> dict:
    subs = httpx.get(f"http://127.0.0.1:{broker.ports['management']}/api/subscriptions", timeout=10).json()
    return next(s for s in subs if s["name"] == name)


def test_every_snippet_has_a_runner():
    tested = DOC.read_text().count("*(tested")
    assert set(snippets()) == {"python-queue", "python-shared-durable", "rhea-queue", "rhea-shared-durable",
                               "rhea-browser"}
    assert tested == len(snippets()), "each snippet said to be tested is marked, and each marked one is run"


def test_python_queue(broker_factory):
    b = broker_factory()
    assert run_python(at(snippets()["python-queue"], b)).splitlines() == ["order 1"]


def test_python_shared_durable_subscription(broker_factory):
    b = broker_factory()
    out = run_python(at(snippets()["python-shared-durable"], b))
    assert out.strip() == "['order 0', 'order 1', 'order 2', 'order 3']"
    sub = subscription(b, "billing")
    assert (sub["durable"], sub["shared"], sub["global"]) == (True, True, True), sub
    assert sub["topic"] in ("orders", "amq.topic/orders"), sub


def test_rhea_queue(broker_factory, tmp_path):
    b = broker_factory()
    assert run_node(at(snippets()["rhea-queue"], b), tmp_path).splitlines() == ["order 1"]


def test_rhea_shared_durable_subscription(broker_factory, tmp_path):
    b = broker_factory()
    assert run_node(at(snippets()["rhea-shared-durable"], b), tmp_path).splitlines() == ["order 1"]
    sub = subscription(b, "billing")
    assert (sub["durable"], sub["shared"], sub["global"]) == (True, True, True), sub
    assert sub["consumers"] == 0, "the consumer left, the durable subscription stays"


@pytest.mark.browser
def test_rhea_in_the_browser_over_websocket(broker_factory, tmp_path):
    from tests.browser.test_console import CHROMEDRIVER, CHROMIUM, FLAGS, wait_for
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # The page is served from this host: the documented "same-host" origin lets it in.
    b = broker_factory('[websocket]\nport = 0\nallowed_origins = ["same-host"]\n')
    (tmp_path / "page.html").write_text(at(snippets()["rhea-browser"], b))
    shutil.copy(ensure_node_modules() / "node_modules" / "rhea" / "dist" / "rhea.js", tmp_path / "rhea.js")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        drv.get(f"http://127.0.0.1:{httpd.server_address[1]}/page.html")
        text = wait_for(lambda: drv.find_element("id", "log").text, timeout=20, what="the page's log")
        assert text.strip() == "received: hello from the browser"
    finally:
        drv.quit()
        httpd.shutdown()
