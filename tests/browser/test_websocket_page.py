"""AMQP over WebSocket from a real browser: headless Chromium loads a page with
rhea's browser bundle (tests/e2e/wsclient/page.html, node_modules/rhea/dist/rhea.js)
that sends messages to the broker's WebSocket listener and receives them back;
a python-qpid-proton client on the TCP listener sees the same queue."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
import uuid

import pytest
from proton import Message

from tests.browser.test_console import driver, wait_for  # noqa: F401 — the chromium fixture
from tests.client import connect
from tests.e2e.websocket_support import ensure_node_modules

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture
def page_server(tmp_path):
    """The page and rhea's browser bundle over HTTP (another origin than the broker's:
    WebSocket connections are not bound by the same-origin policy; the broker's
    `[websocket] allowed_origins` decides)."""
    wsclient = ensure_node_modules()
    shutil.copy(wsclient / "page.html", tmp_path / "page.html")
    shutil.copy(wsclient / "node_modules" / "rhea" / "dist" / "rhea.js", tmp_path / "rhea.js")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def run_page(drv, base: str, ws_url: str, address: str, count: int) -> dict:
    from selenium.webdriver.common.by import By
    drv.get(f"{base}/page.html?url={ws_url}&address={address}&count={count}")
    text = wait_for(lambda: (t := drv.find_element(By.ID, "result").text) != "running" and t,
                    timeout=20, what="the page's result")
    return json.loads(text)


def test_browser_sends_and_receives_over_websocket(broker_factory, driver, page_server):  # noqa: F811
    b = broker_factory(f'[websocket]\nport = 0\nallowed_origins = ["{page_server}"]\n')
    ws_url = f"ws://127.0.0.1:{b.ports['ws']}/"
    q = f"browser.{uuid.uuid4().hex[:8]}"
    result = run_page(driver, page_server, ws_url, q, 20)
    assert result["error"] is None
    assert result["received"] == [f"browser-{i}" for i in range(20)]
    assert "user=anonymous" in b.wait_for_log(r"connection open: .*container=browser-")

    # A message from a TCP client reaches the browser on the same queue, and back.
    conn = connect(b.url)
    try:
        conn.create_sender(q).send(Message(body="from tcp"))
        second = run_page(driver, page_server, ws_url, q, 2)
        assert second["error"] is None
        assert second["received"][0] == "from tcp"
    finally:
        conn.close()


def test_a_page_from_an_origin_not_allowed_reads_nothing(broker_factory, driver, page_server):  # noqa: F811
    """Cross-site WebSocket hijacking: a page from any site, opened in the browser of
    someone on the broker's machine, used to read every message of an anonymous
    loopback broker.  Not in allowed_origins: the upgrade is refused (403)."""
    b = broker_factory('[websocket]\nport = 0\nallowed_origins = ["https://console.example.com"]\n')
    q = f"secret.{uuid.uuid4().hex[:8]}"
    conn = connect(b.url)
    try:
        conn.create_sender(q).send(Message(body="payroll"))
    finally:
        conn.close()
    result = run_page(driver, page_server, f"ws://127.0.0.1:{b.ports['ws']}/", q, 1)
    assert result["error"] is not None and result["received"] == []
    b.wait_for_log(rf"ws: upgrade request from 127\.0\.0\.1:\d+ refused: a page from "
                   rf"{page_server.replace('.', '[.]')} may not connect")
    assert "container=browser-" not in b.log_text()
