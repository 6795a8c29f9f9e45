"""The web console in a real headless browser (Debian's chromium + chromedriver,
driven by selenium): it shows a subscription a python-qpid-proton client made,
highlights it as abandoned, and deletes it through the UI; the broker agrees."""

from __future__ import annotations

import shutil
import time
import uuid

import httpx
import pytest
from proton import Message
from proton.utils import LinkDetached

from tests.client import connect
from tests.e2e.jms_links import detach, null_source_attach, shared_consumer

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
         "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def driver():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 — the DOM is being replaced under us: try again
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def table_rows(driver, table: str) -> list:
    """(data-name, [cell texts], class) of every row, read in one script: the console
    re-renders its tables as it refreshes, and elements found one call earlier may
    be gone by the next."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".map(r => [r.dataset.name, Array.from(r.cells).map(td => td.innerText.trim()), r.className]);",
        f"#{table} tbody tr")


def cells_of(driver, table: str, name: str) -> list | None:
    return next((cells for n, cells, _ in table_rows(driver, table) if n == name), None)


def click_in_row(driver, table: str, name: str, css: str) -> None:
    """Click a button of a row, finding the row again when a refresh replaced it."""
    from selenium.webdriver.common.by import By
    wait_for(lambda: row(driver, table, name).find_element(By.CSS_SELECTOR, css).click() or True,
             what=f"{css} of {name}")


def row(driver, table: str, name: str):
    from selenium.webdriver.common.by import By
    rows = driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
    return next((r for r in rows if r.get_attribute("data-name") == name), None)


def click_and_confirm(driver, table: str, name: str, css: str) -> str:
    click_in_row(driver, table, name, css)
    alert = wait_for(lambda: _alert(driver), what="the confirm dialog")
    text = alert.text
    alert.accept()
    return text


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException
    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return None


def test_console_deletes_an_abandoned_subscription(broker, driver):
    from selenium.webdriver.common.by import By

    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    topic, sub, cid = uniq("t"), uniq("console-sub"), uniq("console-app")
    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0)
    publisher = connect(broker.url, container_id=uniq("pub"))
    publisher.create_sender(f"amq.topic/{topic}").send(Message(body="pending"))
    publisher.close()

    driver.get(mgmt + "/")
    assert driver.title == "amqpbroker console"
    cells = wait_for(lambda: cells_of(driver, "subscriptions", sub), what="the subscription row")
    assert cells[1] == cid and cells[2] == f"amq.topic/{topic}" and cells[5] == "1" and cells[6] == "1"
    assert all("abandoned" not in cls for n, _, cls in table_rows(driver, "subscriptions") if n == sub)
    wait_for(lambda: any(r.get_attribute("data-container") == cid
                         for r in driver.find_elements(By.CSS_SELECTOR, "#connections tbody tr")),
             what="the connection row")

    # The consumer goes away; with "abandoned after 0s" the row is highlighted.
    assert detach(conn, consumer) is None
    idle = driver.find_element(By.ID, "idle")
    idle.clear()
    idle.send_keys("0s")
    driver.execute_script("document.getElementById('idle').dispatchEvent(new Event('change'))")
    wait_for(lambda: any(n == sub and "abandoned" in cls for n, _, cls in table_rows(driver, "subscriptions")),
             what="the abandoned highlight")

    text = click_and_confirm(driver, "subscriptions", sub, "button.delete")
    assert sub in text and "1 pending message" in text
    wait_for(lambda: row(driver, "subscriptions", sub) is None, what="the row to go")
    assert not driver.find_element(By.ID, "error").is_displayed()

    subs = httpx.get(mgmt + "/api/subscriptions", timeout=10).json()
    assert sub not in [s["name"] for s in subs]
    with pytest.raises(LinkDetached) as lookup:
        null_source_attach(conn, sub)
    assert "amqp:not-found" in str(lookup.value)
    conn.close()


def test_console_purges_a_queue_and_refreshes_live(broker, driver):

    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    q = uniq("console-q")
    driver.get(mgmt + "/console/")
    conn = connect(broker.url, container_id=uniq("c"))
    snd = conn.create_sender(q)
    for i in range(3):
        snd.send(Message(body=i))
    # No reload: the 2 s poll brings the new queue in.
    wait_for(lambda: (cells_of(driver, "queues", q) or [None, None])[1] == "3", what="the queue row")
    click_and_confirm(driver, "queues", q, "button.purge")
    wait_for(lambda: httpx.get(f"{mgmt}/api/queues/{q}", timeout=10).json()["depth"] == 0, what="the purge")
    wait_for(lambda: (cells_of(driver, "queues", q) or [None, None])[1] == "0", what="the refreshed depth")
    conn.close()


def test_console_shows_api_errors(broker, driver):
    from selenium.webdriver.common.by import By

    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    topic, sub, cid = uniq("t"), uniq("busy-sub"), uniq("busy-app")
    conn = connect(broker.url, container_id=cid)
    shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0)
    driver.get(mgmt + "/console/")
    wait_for(lambda: row(driver, "subscriptions", sub), what="the subscription row")
    click_in_row(driver, "subscriptions", sub, "button.delete")
    wait_for(lambda: _alert(driver), what="confirm").accept()
    second = wait_for(lambda: _alert(driver), what="the force question")
    assert "consumer(s) attached" in second.text
    second.dismiss()
    error = wait_for(lambda: (e := driver.find_element(By.ID, "error")).is_displayed() and e,
                     what="the error box")
    assert "consumer(s) attached" in error.text
    assert sub in [s["name"] for s in httpx.get(mgmt + "/api/subscriptions", timeout=10).json()]
    conn.close()


def test_console_pages_filters_and_sorts_queues(broker, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    prefix = uniq("page")
    with httpx.Client(base_url=mgmt, timeout=10) as c:
        for i in range(57):
            assert c.post("/api/queues", json={"name": f"{prefix}-{i:02d}", "durable": False}).status_code == 201
    conn = connect(broker.url, container_id=uniq("c"))
    snd = conn.create_sender(f"{prefix}-33")
    for i in range(4):
        snd.send(Message(body=i))
    conn.close()

    def shown():
        return [r[0] for r in table_rows(driver, "queues")]

    def page_text():
        return driver.find_element(By.ID, "queue-page").text

    driver.get(mgmt + "/console/")
    box = wait_for(lambda: driver.find_element(By.ID, "queue-filter"), what="the filter box")
    box.send_keys(prefix)
    wait_for(lambda: page_text() == "1–50 of 57" and shown() == [f"{prefix}-{i:02d}" for i in range(50)],
             what="the first page of the filtered queues")
    assert driver.find_element(By.ID, "queue-count").text == "57"
    assert driver.find_element(By.ID, "queue-prev").get_attribute("disabled") is not None

    driver.find_element(By.ID, "queue-next").click()
    wait_for(lambda: page_text() == "51–57 of 57" and shown() == [f"{prefix}-{i:02d}" for i in range(50, 57)],
             what="the second page")
    assert driver.find_element(By.ID, "queue-next").get_attribute("disabled") is not None

    Select(driver.find_element(By.ID, "queue-sort")).select_by_value("depth")
    wait_for(lambda: page_text() == "1–50 of 57" and shown()[:1] == [f"{prefix}-33"], what="deepest first")
    assert cells_of(driver, "queues", f"{prefix}-33")[1] == "4"

    box.clear()
    box.send_keys(f"{prefix}-1?")
    wait_for(lambda: shown() == [f"{prefix}-{i}" for i in range(10, 20)], what="the glob filter")
    box.clear()
    box.send_keys("no-such-queue-anywhere")
    wait_for(lambda: driver.find_element(By.CSS_SELECTOR, "#queues tbody td.empty").text == "no queue matches",
             what="the empty result")


def test_console_browses_a_queue_and_moves_its_messages(broker, driver):
    from selenium.webdriver.common.by import By

    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    src, dst = uniq("console-src"), uniq("console-dst")
    conn = connect(broker.url, container_id=uniq("c"))
    conn.create_sender(dst)
    snd = conn.create_sender(src)
    for i in range(3):
        snd.send(Message(body=f"hello-{i}", subject="greeting", properties={"i": i}))
    driver.get(mgmt + "/console/")
    wait_for(lambda: row(driver, "queues", src), what="the queue row")
    click_in_row(driver, "queues", src, "button.browse")
    shown = wait_for(lambda: (rows := driver.execute_script(
        "return Array.from(document.querySelectorAll('#messages tbody tr[data-seq]'))"
        ".map(r => Array.from(r.cells).map(td => td.innerText.trim()));")) and len(rows) == 3 and rows,
        what="the messages panel")
    cells = shown[0]
    assert cells[3] == "greeting" and cells[8] == "hello-0" and '"i":0' in cells[6]
    assert httpx.get(f"{mgmt}/api/queues/{src}", timeout=10).json()["delivered_total"] == 0
    driver.find_element(By.ID, "messages-move").click()
    prompt = wait_for(lambda: _alert(driver), what="the move prompt")
    prompt.send_keys(dst)
    prompt.accept()
    wait_for(lambda: httpx.get(f"{mgmt}/api/queues/{dst}", timeout=10).json()["depth"] == 3, what="the move")
    wait_for(lambda: "no waiting messages" in driver.find_element(By.ID, "messages").text, what="the emptied panel")
    assert httpx.get(f"{mgmt}/api/queues/{src}", timeout=10).json()["depth"] == 0
    conn.close()


def test_console_shows_the_ha_pair_and_nothing_for_a_broker_alone(broker, driver, tmp_path):
    """The header's HA badge (GET /api/ha): hidden for a broker that runs alone; for the
    live broker of a real pair (Debian's ZooKeeper, tests/e2e/ha_harness.py) its status,
    role and activation, the backup in sync and the ZooKeeper session."""
    from selenium.webdriver.common.by import By

    from tests.e2e.ha_harness import HaBroker, ZooKeeper, free_port, pair_config

    driver.get(f"http://127.0.0.1:{broker.ports['management']}/console/")
    wait_for(lambda: driver.find_element(By.ID, "overview").text, what="the overview")
    assert not driver.find_element(By.ID, "ha").is_displayed()
    zk = ZooKeeper(tmp_path / "zk").start()
    cluster = uuid.uuid4().hex[:8]
    pair = [HaBroker(name, tmp_path / name, pair_config(zk, cluster, role, port), port)
            for name, role, port in (("a", "primary", free_port()), ("b", "backup", free_port()))]
    try:
        pair[0].start().wait_live()
        pair[1].start().wait_for_log("in sync with the live broker", 30)
        driver.get(f"http://127.0.0.1:{pair[0].ports['management']}/console/")
        badge = wait_for(lambda: (e := driver.find_element(By.ID, "ha")).is_displayed()
                         and "in-sync" in e.text and e, what="the HA badge")
        assert badge.text.startswith("HA live (primary, activation ")
        assert "ZooKeeper CONNECTED" in badge.text and "degraded" not in badge.get_attribute("class")
    finally:
        for b in pair:
            b.kill()
        zk.stop()
