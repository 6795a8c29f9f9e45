"""The management API's interactive docs (/docs, /redoc) work without internet:
every script and stylesheet comes from the broker's own listener.  The page is
loaded in headless Chromium with every non-loopback request sent to a dead proxy,
and must show the API's operations."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.browser.test_console import FLAGS, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture(scope="module")
def docs_broker(tmp_path_factory):
    from tests.broker_process import BrokerProcess
    proc = BrokerProcess(tmp_path_factory.mktemp("docs") / "data").start()
    yield proc
    proc.stop()


def base(broker) -> str:
    return f"http://127.0.0.1:{broker.ports['management']}"


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_nothing_from_elsewhere(docs_broker, page):
    html = httpx.get(base(docs_broker) + page, timeout=10).text
    sources = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html) + re.findall(r"url:\s*'([^']+)'", html)
    assert sources, html
    foreign = [s for s in sources if re.match(r"(https?:)?//", s)]
    assert not foreign, f"{page} loads {foreign}"
    for src in sources:
        got = httpx.get(base(docs_broker) + src, timeout=10)
        assert got.status_code == 200 and got.content, src


def test_an_unknown_docs_asset_is_404(docs_broker):
    assert httpx.get(base(docs_broker) + "/docs-assets/../api.py", timeout=10).status_code == 404
    assert httpx.get(base(docs_broker) + "/docs-assets/nothing.js", timeout=10).status_code == 404


def test_swagger_ui_shows_the_operations_offline(docs_broker):
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from tests.browser.test_console import CHROMEDRIVER, CHROMIUM
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + ["--proxy-server=http://127.0.0.1:9"]:    # offline: only loopback answers
        options.add_argument(flag)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        drv.set_page_load_timeout(30)
        drv.get(base(docs_broker) + "/docs")
        operations = wait_for(lambda: drv.execute_script(
            "return Array.from(document.querySelectorAll('.opblock-summary-path')).map(e => e.innerText)"),
            timeout=30, what="Swagger UI's operations")
        assert "/api/queues" in [o.strip() for o in operations], operations
        assert "amqpbroker management API" in drv.find_element("css selector", ".title").text
    finally:
        drv.quit()
