"""The live run page (``coordinator serve --web``): its JSON API and event stream on a ledger
written by hand (Starlette's TestClient, fast), and the page itself in headless Chromium
following a real 3-site chain as it happens (skipped where no browser is installed)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from conftest import new_run

pytestmark = pytest.mark.integration

ORDER = ["site-a", "site-b", "site-c"]
M = 1000


@pytest.fixture
def client(service):
    from starlette.testclient import TestClient

    from fedrelay.coordinator.web import create_app

    with TestClient(create_app(service), base_url="http://localhost") as c:
        yield c


def test_run_list_and_one_run_as_it_progresses(service, client):
    ledger = service.ledger
    new_run(ledger, "r1", ORDER)
    ledger.add_event("r1", "started", "run r1")
    ledger.add_event("r1", "state", "site-a: training", site="site-a", state="training", detail="")
    ledger.record_metric("r1", "site-a", "warmup", 0, 1, 2, 2.3, 0.25, 0.5)
    ledger.add_event("r1", "epoch", "site-a: warmup 1/2", site="site-a", stage="warmup", model=0, epoch=1,
                     epochs=2, train_loss=2.3, val_accuracy=0.25, seconds=0.5)
    ledger.add_event("r1", "state", "site-b: assigned", site="site-b", state="assigned", detail="waiting for hop 1")

    runs = client.get("/api/runs").json()
    assert [(r["run_id"], r["status"], r["sites"]) for r in runs] == [("r1", "running", ORDER)]
    view = client.get("/api/runs/r1").json()
    assert view["status"] == "running" and view["order"] == ORDER
    assert view["sites"]["site-a"]["state"] == "training"
    assert view["sites"]["site-a"]["label"] == "training (warm-up, epoch 1/2)"
    assert view["sites"]["site-b"]["state"] == "waiting" and view["sites"]["site-c"]["state"] == "waiting"
    # The table lists the whole plan before anything moved: 2 hops, 2 final copies, all planned.
    assert [(t["key"], t["sender"], t["receiver"], t["status"]) for t in view["transfers"]] == [
        ("chain:1", "site-a", "site-b", "planned"), ("chain:2", "site-b", "site-c", "planned"),
        ("final:site-a", "site-c", "site-a", "planned"), ("final:site-b", "site-c", "site-b", "planned")]
    assert [(m["site"], m["epoch"], m["val_accuracy"]) for m in view["metrics"]] == [("site-a", 1, 0.25)]
    assert [s["kind"] for s in view["timeline"] if s["site"] == "site-a"] == ["training"]
    last = view["last_seq"]
    assert last == view["events"][-1]["seq"]

    # Hop 1: both ends report, so its row is done with its bytes and digest; site-a is done.
    ledger.record_hop("r1", "chain", 1, "site-a", "site-b", M, M + 50, "a" * 64, 10.0, 12.5, attempts=2)
    ledger.record_receipt("r1", "chain", 1, "site-a", "site-b", M, "a" * 64, "", 12.6)
    ledger.add_event("r1", "state", "site-a: done", site="site-a", state="done", detail="")
    view = client.get("/api/runs/r1").json()
    hop1 = view["transfers"][0]
    assert (hop1["status"], hop1["payload_bytes"], hop1["sha256"], hop1["attempts"], hop1["seconds"]) == (
        "done", M, "a" * 64, 2, 2.5)
    assert view["sites"]["site-a"]["state"] == "done"
    assert any(s["kind"] == "transfer" and s["key"] == "chain:1" for s in view["timeline"])
    assert view["last_seq"] > last

    # Before any evaluation the table of the final model has a row per site and no figure.
    table = view["final_table"]
    assert table["columns"] == [["accuracy", "accuracy"]] and table["global"] is None
    assert [(r["site"], r["values"]) for r in table["rows"]] == [(n, {}) for n in ORDER]

    # The run ends: each site's metrics (built-in and the task's own), a finished status.
    for i, (site, acc) in enumerate(zip(ORDER, (0.5, 0.6, 0.7))):
        metrics = {"auroc": 0.8 + i / 100, "macro_f1": acc - 0.1, "top2_accuracy": 0.9}
        ledger.record_evaluation("r1", site, "f" * 64, int(acc * 10), 10, acc, 0.1, metrics)
        ledger.add_event("r1", "evaluated", f"{site}: accuracy", site=site, accuracy=acc, test_samples=10,
                         metrics=metrics)
        if i == 0:  # an evaluation shows as it arrives
            row = client.get("/api/runs/r1").json()["final_table"]["rows"][0]
            assert row == {"site": "site-a", "values": {"accuracy": 0.5, **metrics}, "test_samples": 10}
    ledger.finish_run("r1", "finished", accuracy=0.6, message="run finished",
                      metrics={"accuracy": 0.6, "auroc": 0.85, "macro_f1": 0.5, "top2_accuracy": 0.9})
    view = client.get("/api/runs/r1").json()
    assert view["status"] == "finished"
    assert {s: v["accuracy"] for s, v in view["sites"].items()} == {"site-a": 0.5, "site-b": 0.6, "site-c": 0.7}
    # The final model's table: accuracy, the other built-in metrics in their order, then the
    # task's own; per site and global.
    table = view["final_table"]
    assert table["columns"] == [["accuracy", "accuracy"], ["macro_f1", "macro-F1"], ["auroc", "AUROC"],
                                ["top2_accuracy", "top2_accuracy"]]
    assert [(r["site"], r["values"]["accuracy"], r["values"]["top2_accuracy"], r["test_samples"])
            for r in table["rows"]] == [("site-a", 0.5, 0.9, 10), ("site-b", 0.6, 0.9, 10), ("site-c", 0.7, 0.9, 10)]
    assert table["global"] == {"values": {"accuracy": 0.6, "auroc": 0.85, "macro_f1": 0.5, "top2_accuracy": 0.9},
                               "test_samples": 30}


def test_a_star_run_lists_its_uploads_and_final_copies(service, client):
    from fedrelay.coordinator.plan import star_plan

    service.ledger.create_run("s1", strategy="fedavg", arch="cnn", seed=1, params={},
                              chain=[{"name": n, "address": "127.0.0.1:9"} for n in ORDER], class_index=["x"],
                              model={}, warnings=[], insecure=True, plan=star_plan(ORDER, "site-b").to_json())
    service.ledger.record_hop("s1", "upload", 1, "site-a", "site-b", M + 80, M + 130, "u" * 64, 1.0, 2.0)
    view = client.get("/api/runs/s1").json()
    assert view["aggregator"] == "site-b"
    assert [(t["key"], t["sender"], t["receiver"], t["status"]) for t in view["transfers"]] == [
        ("upload:1", "site-a", "site-b", "sent"), ("upload:3", "site-c", "site-b", "planned"),
        ("final:site-a", "site-b", "site-a", "planned"), ("final:site-c", "site-b", "site-c", "planned")]


def test_unknown_run_is_a_404_page_not_a_traceback(service, client):
    for path in ("/runs/nope", "/runs/nope/events", "/elsewhere"):
        res = client.get(path)
        assert res.status_code == 404 and "text/html" in res.headers["content-type"]
        assert "Traceback" not in res.text and "Not found" in res.text
    res = client.get("/api/runs/nope")
    assert res.status_code == 404 and res.json() == {"error": "unknown run 'nope'"}
    res = client.get("/runs/%3Cscript%3E")  # the name is escaped in the page
    assert res.status_code == 404 and "<script>" not in res.text
    assert client.post("/api/runs").status_code == 405  # read-only


def test_pages_and_assets_are_served_from_the_package(service, client):
    new_run(service.ledger, "r2", ORDER)
    page = client.get("/runs/r2")
    assert page.status_code == 200 and 'id="graph"' in page.text and 'id="transfers"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    assert client.get("/").status_code == 200
    for asset in ("/static/run.js", "/static/runs.js", "/static/page.css", "/static/vendor/uPlot.iife.min.js",
                  "/static/vendor/uPlot.min.css"):
        assert client.get(asset).status_code == 200, asset


def test_event_stream_resumes_after_last_event_id_and_ends_with_the_run(service, client):
    ledger = service.ledger
    new_run(ledger, "r3", ORDER)
    first = ledger.add_event("r3", "started", "one")
    ledger.add_event("r3", "state", "two", site="site-a", state="training")
    ledger.finish_run("r3", "failed", error="boom", message="run failed: boom", site="site-a")
    with client.stream("GET", "/runs/r3/events", headers={"Last-Event-ID": str(first)}) as res:
        assert res.headers["content-type"].startswith("text/event-stream")
        text = "".join(res.iter_text())
    blocks = [b for b in text.split("\n\n") if b.strip()]
    ids = [int(line[4:]) for b in blocks for line in b.splitlines() if line.startswith("id: ")]
    assert ids == [first + 1, first + 2]  # after Last-Event-ID, in ledger order
    data = [json.loads(line[6:]) for b in blocks for line in b.splitlines() if line.startswith("data: ")]
    assert [d.get("message") for d in data[:2]] == ["two", "run failed: boom"]
    assert blocks[-1].startswith("event: end") and data[-1] == {"status": "failed"}
    view = client.get("/api/runs/r3").json()
    assert view["sites"]["site-a"]["state"] == "failed"


def test_web_address_default_host_and_bad_addresses():
    from fedrelay.coordinator.web import parse_web_address
    from fedrelay.coordinator.web.app import is_loopback

    assert parse_web_address("8070") == ("127.0.0.1", 8070)
    assert parse_web_address("0.0.0.0:8070") == ("0.0.0.0", 8070)
    assert parse_web_address("[::1]:8070") == ("::1", 8070)
    for bad in ("", "host:", "host:http", "99999"):
        with pytest.raises(ValueError, match="--web"):
            parse_web_address(bad)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


# -- the page in a browser, following a real run ---------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chrome():
    """A headless Chromium driven by the system chromedriver, or pytest.skip with the reason."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=opts)
    # The page's viewport itself 1280x900 (the window size above includes the browser's frame).
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False})
    return browser


def test_the_page_follows_a_real_run_in_a_browser(three_sites, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from deploy import local_trial

    browser = chrome()
    web = free_port()
    try:
        with local_trial.LocalTrial(tmp_path / "trial", three_sites, insecure=True,
                                    coordinator_args=["--web", f"127.0.0.1:{web}"]) as trial:
            res = trial.cli("start-chain", "--seed", "3", "--peers", ",".join(trial.names), "--json",
                            "--models-per-site", "1", "--local-epochs", "2", "--warmup-epochs", "1",
                            "--batch-size", "32", capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            run_id = json.loads(res.stdout)["run_id"]
            browser.get(f"http://127.0.0.1:{web}/runs/{run_id}")
            # The page redraws the graph as events arrive: an element found may be gone when read
            # (StaleElementReferenceException), so the waits read in one go and try again.
            wait = WebDriverWait(browser, 45, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))
            # Every site is drawn in the graph, and the plan's hops are rows of the table.
            drawn = wait.until(lambda b: (lambda names: names if len(names) == 3 else False)(
                [e.get_attribute("data-site") for e in b.find_elements(By.CSS_SELECTOR, "#graph [data-site]")]))
            assert sorted(drawn) == trial.names
            # While the run is still running, a site is seen training and hop 1 arrives in the
            # table (pushed by the event stream: the page is never reloaded).
            marker = browser.execute_script("window.__notReloaded = true; return window.__notReloaded;")
            assert marker is True
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#graph [data-state="training"]'))
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#transfers tr[data-hop="chain:1"][data-status="done"]'))
            status_then = browser.find_element(By.ID, "run-status").get_attribute("data-status")
            assert status_then == "running"
            # Then the run finishes: every site done with its accuracy, both hops done.
            wait.until(lambda b: b.find_element(By.ID, "run-status").get_attribute("data-status") == "finished")
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, '#graph [data-state="done"]')) == 3)
            wait.until(lambda b: all(e.text not in ("", "–") for e in
                                     b.find_elements(By.CSS_SELECTOR, "#final tr[data-site] td.num:nth-child(2)")))
            assert browser.execute_script("return window.__notReloaded === true")
            shown = json.loads(trial.cli("show", run_id, "--json", capture_output=True, text=True, timeout=60).stdout)
            for h in shown["hops"]:
                row = browser.find_element(By.CSS_SELECTOR, f'#transfers tr[data-hop="chain:{h["hop"]}"]')
                assert f'{h["sender"]} → {h["receiver"]}' in row.text and h["sha256"][:10] in row.text
                assert f'{h["payload_bytes"]:,}' in row.text
                path = browser.find_element(By.CSS_SELECTOR, f'#graph path[data-hop="chain:{h["hop"]}"]')
                assert path.get_attribute("data-status") == "done"
            for site, v in shown["final"]["per_site"].items():
                cell = browser.find_element(By.CSS_SELECTOR, f'#final tr[data-site="{site}"] td:nth-child(2)')
                assert cell.text == f'{v["accuracy"]:.4f}'
                for name, value in v["metrics"].items():  # a column per metric, the task's own too
                    cell = browser.find_element(By.CSS_SELECTOR, f'#final tr[data-site="{site}"] td[data-metric="{name}"]')
                    assert cell.text == f"{value:.4f}"
            for name, value in shown["final"]["metrics"].items():
                cell = browser.find_element(By.CSS_SELECTOR, f'#final tr.global th[data-metric="{name}"]')
                assert cell.text == f"{value:.4f}"
            assert browser.find_elements(By.CSS_SELECTOR, "#curve-acc canvas")  # uPlot drew the curves
            # The list of runs links to it.
            browser.get(f"http://127.0.0.1:{web}/")
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, f'#runs tr[data-run="{run_id}"][data-status="finished"]'))
            if os.environ.get("FEDRELAY_SCREENSHOT"):
                browser.get(f"http://127.0.0.1:{web}/runs/{run_id}")
                wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#curve-acc canvas"))
                Path(os.environ["FEDRELAY_SCREENSHOT"]).parent.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(os.environ["FEDRELAY_SCREENSHOT"])
    finally:
        browser.quit()


def test_the_server_starts_on_a_port_and_stops_with_a_stream_still_open(service):
    """``start_web`` serves on a real socket (a bare port: 127.0.0.1); ``stop()`` ends an open
    event stream of a running run instead of waiting for the run."""
    import urllib.request

    from fedrelay.coordinator.web import start_web

    new_run(service.ledger, "r4", ORDER)
    service.ledger.add_event("r4", "started", "one")
    page = start_web(str(free_port()), service)
    assert page.url.startswith("http://127.0.0.1:")
    try:
        with urllib.request.urlopen(page.url + "api/runs", timeout=10) as res:
            assert [r["run_id"] for r in json.load(res)] == ["r4"]
        stream = urllib.request.urlopen(page.url + "runs/r4/events", timeout=10)
        assert stream.readline() == b"retry: 2000\n"
        assert [stream.readline() for _ in range(2)] == [b"\n", b"id: 1\n"]
        stream.readline(), stream.readline()
        # An event added while the stream is open arrives on it (the bell wakes the stream).
        seq = service.ledger.add_event("r4", "state", "later", site="site-a", state="training")
        assert stream.readline() == f"id: {seq}\n".encode()
        assert json.loads(stream.readline()[len(b"data: "):])["message"] == "later"
    finally:
        started = time.monotonic()
        page.stop()
    assert time.monotonic() - started < 5
    assert stream.read().strip() == b""  # the server closed the stream (a hanging one would time out)
