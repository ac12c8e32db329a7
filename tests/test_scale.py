"""The coordinator at many sites: ledger writes per hop do not grow with N, watchers read memory."""

from __future__ import annotations

import pytest

from bench.scale import WriteCounter, measure
from conftest import image_offer_pbs, image_offers
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb


class Context:
    def is_active(self) -> bool:
        return True

    def auth_context(self) -> dict:
        return {}

    def abort(self, code, message):
        raise AssertionError(f"{code}: {message}")


@pytest.mark.integration
def test_sqlite_writes_per_hop_do_not_grow_with_the_number_of_sites(tmp_path):
    small, large = (measure(n, 0.0, tmp_path / f"n{n}") for n in (3, 30))
    assert small["evaluated"] == 3 and large["evaluated"] == 30
    assert large["writes_per_hop"] <= small["writes_per_hop"]
    assert large["reads_per_hop"] <= small["reads_per_hop"]


def test_watch_run_reads_the_ledger_once_to_catch_up_then_memory_only():
    counter = WriteCounter()
    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    try:
        order = ["a", "b"]
        ledger.create_run("r", strategy="fedelmy", arch="cnn", seed=1, params={},
                          chain=[{"name": n, "address": "127.0.0.1:9"} for n in order], class_index=["x"], model={},
                          warnings=[], insecure=True, plan=chain_plan(order).to_json())
        for k in range(3):
            ledger.add_event("r", "state", f"early {k}", site="a", state="training")
        ledger.store.db.set_trace_callback(counter)
        stream = service.WatchRun(cpb.WatchRunRequest(run_id="r"), Context())
        assert [next(stream).message for _ in range(3)] == ["early 0", "early 1", "early 2"]
        caught_up = counter.reads
        assert caught_up <= 2  # the run's row, and at most one catch-up read
        assert service.events.watchers("r") == 1
        for k in range(20):
            ledger.add_event("r", "epoch", f"live {k}", site="b")
            assert next(stream).message == f"live {k}"
        assert counter.reads == caught_up  # no SQLite read per event
        ledger.finish_run("r", "failed", error="x", message="run failed: x")
        assert next(stream).kind == "failed"
        assert list(stream) == [] and service.events.watchers("r") == 0
    finally:
        service.close()
        ledger.close()


def test_heartbeats_that_change_nothing_write_nothing_and_still_show_last_seen():
    counter = WriteCounter()
    ledger = Ledger(":memory:")
    ledger.store.db.set_trace_callback(counter)
    classes = image_offers({"c": (5, 1)})
    assert ledger.upsert_peer("a", "127.0.0.1:1", classes, "cpu", "1")
    first, writes = ledger.peer("a")["last_seen"], counter.writes
    for _ in range(5):
        assert not ledger.upsert_peer("a", "127.0.0.1:1", classes, "cpu", "1")
    assert counter.writes == writes
    assert ledger.peers()[0]["last_seen"] >= first and ledger.last_seen()["a"] >= first
    assert ledger.upsert_peer("a", "127.0.0.1:2", classes, "cpu", "1")  # moved: written
    assert ledger.flush_last_seen() == 0
    ledger.upsert_peer("a", "127.0.0.1:2", classes, "cpu", "1")
    assert ledger.flush_last_seen() == 1  # one transaction for every site's heartbeat
    ledger.close()


def test_a_heartbeat_reads_nothing_once_its_site_is_known_and_the_period_bounds_the_total_rate():
    """Re-registrations of a known site read and write no SQL (the registration is kept in
    memory and dropped on any write); the heartbeat period grows with the number of registered
    sites so that all of them together heartbeat about twice a second, and never exceeds a
    quarter of --peer-timeout."""
    from fedrelay.coordinator.registration import HEARTBEATS_PER_SECOND

    class Plaintext:  # a plaintext server's call context: no identities
        def auth_context(self):
            return {}

    counter = WriteCounter()
    ledger = Ledger(":memory:")
    ledger.store.db.set_trace_callback(counter)
    service = CoordinatorService(ledger, peer_timeout=120.0)
    offers = image_offer_pbs({"c": (5, 1)})

    def register(name: str, address: str = "127.0.0.1:1") -> cpb.RegisterReply:
        return service.Register(cpb.RegisterRequest(name=name, address=address, tasks=offers, device="cpu",
                                                    version="1", instance="i-" + name), Plaintext())

    assert register("a").heartbeat_seconds == 10
    register("a")
    reads, writes = counter.reads, counter.writes
    for _ in range(5):
        register("a")
    assert (counter.reads, counter.writes) == (reads, writes)
    assert ledger.peer("a")["address"] == "127.0.0.1:1"
    register("a", "127.0.0.1:2")  # moved: written, and peer() shows it
    assert ledger.peer("a")["address"] == "127.0.0.1:2"
    for i in range(40):
        register(f"s{i:02d}")
    assert register("a").heartbeat_seconds == max(10, -(-41 // int(HEARTBEATS_PER_SECOND)))
    for i in range(40, 200):
        register(f"s{i:03d}")
    assert register("a").heartbeat_seconds == 30  # a quarter of --peer-timeout
    service.close()
    ledger.close()
