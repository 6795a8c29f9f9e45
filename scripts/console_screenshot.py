#!/usr/bin/env python3
"""Make docs/console.png: the web console of a real broker with a little traffic,
showing a dead-letter queue's messages (the Messages panel, with the dead-letter
annotations) under the subscriptions, queues and connections.

    .venv/bin/python scripts/console_screenshot.py [--out docs/console.png]

Needs the test extras (selenium) and Debian's chromium + chromium-driver, as the
browser tests do (scripts/setup.sh installs them).  Starts its own broker on free
ports in a temporary directory and stops it at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from proton import Message

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.broker_process import BrokerProcess  # noqa: E402  (the tests' broker runner)
from tests.client import connect  # noqa: E402
from tests.e2e.jms_links import durable_consumer  # noqa: E402

CONFIG = """
[policy]
dead_letter_address = "DLQ"
max_delivery_attempts = 2

[[queues]]
name = "DLQ"
"""


def traffic(url: str) -> None:
    """Orders (two of them rejected into the DLQ), a durable subscription with a backlog."""
    conn = connect(url, container_id="billing-app")
    snd = conn.create_sender("orders")
    for i in range(6):
        snd.send(Message(body=f"order {i}: 2 x widget", subject="order", durable=True,
                         properties={"customer": f"c-{100 + i}", "total": 19.5 * (i + 1)}))
    rcv = conn.create_receiver("orders", credit=2)
    for _ in range(2):
        rcv.receive(timeout=10)
        rcv.reject()
    rcv.close()
    durable_consumer(conn, "amq.topic/prices", "price-feed", credit=0)
    pub = conn.create_sender("amq.topic/prices")
    for i in range(25):
        pub.send(Message(body={"sku": "widget", "price": 9.99 + i / 100}, durable=True))
    conn.close()


def shoot(mgmt: str, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1050",
                 "--hide-scrollbars", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(mgmt + "/console/")
        deadline = time.monotonic() + 20
        while True:
            rows = [r for r in driver.find_elements(By.CSS_SELECTOR, "#queues tbody tr")
                    if r.get_attribute("data-name") == "DLQ"]
            if rows:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the DLQ row did not show")
            time.sleep(0.2)
        rows[0].find_element(By.CSS_SELECTOR, "button.browse").click()
        while len(driver.find_elements(By.CSS_SELECTOR, "#messages tbody tr[data-seq]")) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the Messages panel did not fill")
            time.sleep(0.2)
        time.sleep(0.5)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(height + 40, 800), 1600))
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs" / "console.png"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", config=CONFIG).start()
        try:
            traffic(broker.url)
            shoot(f"http://127.0.0.1:{broker.ports['management']}", Path(a.out))
        finally:
            broker.stop()
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
