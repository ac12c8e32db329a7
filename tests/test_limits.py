"""Bounded per identity and per endpoint (issue 28, item 4): progress reports rate-limited per run
member (``coordinator/progress_limit.py``), the run page's and metrics endpoint's own connection
limits, ``Host:`` check and cached page data (``coordinator/http_limits.py``, ``coordinator/web``,
``fedrelay/metrics.py``), the gRPC servers' connection bounds (``fedrelay/limits.py``) and the
peer's warm workers held only for planned senders (``peer/workers.py``, ``peer/prepared.py``).

Every test here uses counts and hooks, never sleeps or timing margins."""

from __future__ import annotations

import logging

from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.progress_limit import ProgressLimit
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeContext:
    def abort(self, code, message):
        raise AssertionError(f"aborted: {code} {message}")

    def auth_context(self):
        return {}

    def peer(self):
        return "ipv4:127.0.0.1:1"


def new_run(ledger: Ledger, run_id: str, sites=("a", "b")) -> None:
    ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in sites], class_index=["x"], model={},
                      warnings=[], insecure=True, plan=chain_plan(list(sites)).to_json())


# -- progress reports --------------------------------------------------------------------------------
def test_progress_bucket_refills_at_its_rate_and_logs_once(caplog):
    clock = Clock()
    limit = ProgressLimit(burst=3, rate=2.0, log_window=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="fedrelay.coordinator.progress"):
        assert [limit.admit("r", "a") for _ in range(5)] == [True, True, True, False, False]
        assert limit.admit("r", "b")  # another member has its own bucket
        assert limit.admit("other", "a")  # and so has the same site in another run
        clock.now += 0.5  # one token back
        assert [limit.admit("r", "a") for _ in range(2)] == [True, False]
        assert len(caplog.records) == 1 and "dropping the excess" in caplog.records[0].getMessage()
        clock.now += 61
        assert limit.admit("r", "a")
        for _ in range(10):
            limit.admit("r", "a")
        lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1].startswith("run r: dropped 2 progress reports from a"), lines
    limit.forget("r")
    assert len(limit) == 1


def test_a_flood_of_progress_reports_stops_growing_the_ledger(caplog):
    """2,000 progress reports from one run member: the ledger keeps the bucket's worth, the rest
    are answered as duplicates; one log line says so; another member still reports."""
    ledger = Ledger(":memory:")
    new_run(ledger, "flood")
    service = CoordinatorService(ledger)
    clock = Clock()
    service.progress_limit = ProgressLimit(burst=50, rate=1.0, clock=clock)
    try:
        before = len(ledger.events_after("flood", 0))
        report = cpb.ProgressReport(run_id="flood", site="a", kind="state", state="training", detail="x" * 1000)
        with caplog.at_level(logging.WARNING, logger="fedrelay.coordinator.progress"):
            replies = [service.ReportProgress(report, FakeContext()) for _ in range(2000)]
        assert sum(not r.duplicate for r in replies) == 50
        assert len(ledger.events_after("flood", 0)) - before == 50
        assert len([r for r in caplog.records if r.name == "fedrelay.coordinator.progress"]) == 1
        reply = service.ReportProgress(cpb.ProgressReport(run_id="flood", site="b", kind="state", state="training"),
                                       FakeContext())
        assert not reply.duplicate
    finally:
        service.close()
