"""The console's cluster panel in a real headless browser (chromium + chromedriver, as
tests/browser/test_console.py), against `serve --workers 3` with a partitioned topic:
the nodes and their slots, this node marked, the partitioned destination's members,
and the forwarding figures moving (refreshed live) while a client of this node uses
another node's queue.  A broker that is no node of a cluster shows no panel."""

from __future__ import annotations

import pytest

from tests.browser.test_console import driver, table_rows, wait_for  # noqa: F401 — the chromium fixture
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import receiver
from tests.e2e.test_cluster import owned_by

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

CONFIG = """
[cluster]
handoff = false   # the client of n0 stays there: its link is forwarded
partitioned = [{address = "cprices", members = 2, topic = true}]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("console-cluster") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("const e = document.getElementById(arguments[0]); return e ? e.innerText : '';",
                                 element_id)


def test_the_cluster_panel_shows_nodes_members_and_forwarding(cluster, driver):
    mgmt = f"http://127.0.0.1:{cluster.management_ports()['n0']}"
    driver.get(mgmt + "/")
    rows = wait_for(lambda: len(table_rows(driver, "cluster-nodes")) == 3 and table_rows(driver, "cluster-nodes"),
                    what="a row per node")
    cells = {name: c for name, c, _ in rows}
    assert cells["n0"][:3] == ["n0 (this node)", "live", "0"]
    assert cells["n1"][:3] == ["n1", "live", "128"] and cells["n2"][:3] == ["n2", "live", "128"]
    assert "node n0 · serving" in text_of(driver, "cluster-summary")
    assert "0 of 256 slots here" in text_of(driver, "cluster-summary")
    assert "3/3 live" in text_of(driver, "cluster-badge")
    members = {name: c for name, c, _ in table_rows(driver, "cluster-partitioned")}
    assert set(members) == {"amq.topic/cprices"}
    assert "amq.topic/cprices.p0 on n" in members["amq.topic/cprices"][1]
    assert "amq.topic/cprices.p1 on n" in members["amq.topic/cprices"][1]

    conn = connect(cluster.url)   # n0: its link to n1's queue is forwarded
    try:
        receiver(conn, owned_by("n1"), credit=1)
        wait_for(lambda: {n: c for n, c, _ in table_rows(driver, "cluster-nodes")}["n1"][3] == "1",
                 what="one connection from here to n1 (refreshed without a reload)")
        assert "forwarded for 1 client(s)" in text_of(driver, "cluster-forwarding")
    finally:
        conn.close()
    wait_for(lambda: {n: c for n, c, _ in table_rows(driver, "cluster-nodes")}["n1"][3] == "0",
             what="the connection gone with the client")


def test_a_single_broker_shows_no_cluster_panel(broker, driver):
    mgmt = f"http://127.0.0.1:{broker.ports['management']}"
    driver.get(mgmt + "/")
    wait_for(lambda: driver.execute_script("return document.body.dataset.refreshed"), what="a refresh")
    assert driver.execute_script("return document.getElementById('cluster-panel').hidden") is True
    assert driver.execute_script("return document.getElementById('cluster-badge').hidden") is True
