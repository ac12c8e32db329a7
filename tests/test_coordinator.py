"""Chain planning and the ledger, without a network."""

from __future__ import annotations

import json

import pytest

from conftest import image_offers
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan, replan
from fedrelay.coordinator.plan import PeerInfo, PlanError, choose_sites
from fedrelay.task import DataSummary
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import common_pb2


def peer(name, classes=None, shape=(1, 28, 28), sha="a" * 64, augmentations=()):
    classes = classes if classes is not None else {"a": (10, 5), "b": (3, 5)}
    c, h, w = shape
    offer = Offer(name="image-folder", version="1", sha256=sha, models=("cnn", "resnet18"),
                  summary=DataSummary(classes=classes, input={"channels": c, "height": h, "width": w}),
                  augmentations=augmentations)
    return PeerInfo(name=name, address=f"127.0.0.1:{hash(name) % 1000 + 2000}", offers={"image-folder": offer})


def test_order_is_fixed_by_the_seed_not_by_registration_order():
    peers = [peer(f"site-{i}") for i in range(6)]
    a = choose_sites(peers, seed=3).names
    b = choose_sites(list(reversed(peers)), seed=3).names
    assert a == b and sorted(a) == [p.name for p in peers]
    assert any(choose_sites(peers, seed=s).names != a for s in range(4, 10))


def test_given_order_is_kept():
    peers = [peer("x"), peer("y"), peer("z")]
    assert choose_sites(peers, names=["z", "x", "y"], order="given").names == ["z", "x", "y"]


def test_class_index_is_the_sorted_union_and_single_holders_warn():
    peers = [peer("s1", {"cat": (5, 1), "dog": (0, 0)}), peer("s2", {"cat": (2, 1), "Dog": (4, 1)}),
             peer("s3", {"cat": (1, 1), "bird": (3, 0)})]
    plan = choose_sites(peers, seed=0)
    assert plan.class_index == ["Dog", "bird", "cat"]  # an empty class folder ("dog") adds nothing
    m = plan.model
    assert (m.task, m.model, m.input, m.num_classes, m.task_sha256) == (
        "image-folder", "cnn", {"channels": 1, "height": 28, "width": 28}, 3, "a" * 64)
    assert len(plan.warnings) == 2 and any("'Dog'" in w and "s2" in w for w in plan.warnings)


@pytest.mark.parametrize("peers,kw,words", [
    ([peer("a")], {}, "at least 2"),
    ([peer("a"), peer("b", shape=(3, 28, 28))], {}, "differ"),
    ([peer("a"), peer("b", {"x": (0, 4)})], {}, "without training samples"),
    ([peer("a"), peer("b")], {"names": ["a", "c"]}, "not registered"),
    ([peer("a"), peer("b")], {"names": ["a", "a"]}, "more than once"),
    ([peer("a"), peer("b")], {"model": "vgg"}, "unknown model"),
    ([peer("a"), peer("b", sha="b" * 64)], {}, "different copies of task 'image-folder'.*a{64}.*b{64}"),
    ([peer("a"), peer("b")], {"task_sha256": "c" * 64}, "pins code SHA-256 c{64}.*a has a{64}"),
    ([peer("a"), peer("b")], {"task": "tabular-csv"}, "not installed at a, b"),
    ([peer("a"), peer("b")], {"order": "given"}, "--peers"),
])
def test_impossible_chains_are_refused_clearly(peers, kw, words):
    with pytest.raises(PlanError, match=words):
        choose_sites(peers, **kw)


def test_an_augmentation_a_chosen_sites_task_lacks_is_refused_naming_the_sites_and_what_they_offer():
    flip = ("flip-crop",)
    peers = [peer("a", augmentations=flip), peer("b"), peer("c"), peer("d", augmentations=flip)]
    with pytest.raises(PlanError) as err:
        choose_sites(peers, names=["a", "b", "c", "d"], order="given", augment="flip-crop")
    assert str(err.value) == ("--augment flip-crop: task 'image-folder' has no train-time augmentation 'flip-crop' "
                              "at b, c (they offer: none); use --augment none")
    with pytest.raises(PlanError, match=r"at b \(it offers: none\); use --augment none$"):
        choose_sites(peers, names=["a", "b"], augment="flip-crop")
    mixed = [peer("a", augmentations=("mixup",)), peer("b", augmentations=("mixup", "jitter")), peer("c")]
    with pytest.raises(PlanError, match=r"at a, b, c \(a offers: mixup; b offers: mixup, jitter; c offers: none\); "
                                        r"use --augment none$"):
        choose_sites(mixed, names=["a", "b", "c"], order="given", augment="flip-crop")
    both = [peer("a", augmentations=("mixup", "flip-crop")), peer("b", augmentations=("mixup",))]
    with pytest.raises(PlanError, match=r"at b \(it offers: mixup\); use --augment none or --augment mixup$"):
        choose_sites(both, augment="flip-crop")
    # offered everywhere, or no augmentation asked for: planned as before
    assert choose_sites([peer("a", augmentations=flip), peer("b", augmentations=flip)], seed=1,
                        augment="flip-crop").names == choose_sites(peers[:2], seed=1).names
    assert len(choose_sites(peers, augment="none").names) == len(choose_sites(peers, augment="").names) == 4


def test_an_offer_carries_its_augmentations_through_the_wire_and_the_ledger():
    offer = peer("a", augmentations=("flip-crop", "mixup")).offers["image-folder"]
    assert Offer.from_pb(offer.to_pb()) == offer == Offer.from_dict(json.loads(json.dumps(offer.to_dict())))
    assert list(offer.to_pb().augmentations) == ["flip-crop", "mixup"]
    assert offer.to_dict()["augmentations"] == ["flip-crop", "mixup"]
    old = offer.to_dict()
    del old["augmentations"]  # registered by a daemon from before the field: offers none
    assert Offer.from_dict(old).augmentations == ()
    wire = offer.to_pb()
    wire.ClearField("augmentations")
    assert Offer.from_pb(wire).augmentations == () and Offer.from_pb(wire).models == offer.models


def test_ledger_records_each_hop_once_and_streams_events():
    led = Ledger(":memory:")
    led.create_run("r", strategy="fedelmy", arch="cnn", seed=1, params={}, chain=[{"name": "a", "address": "x:1"}],
                   class_index=["c"], model={}, warnings=[], insecure=True)
    assert led.record_hop("r", "chain", 1, "a", "b", 100, 120, "f" * 64, 1.0, 2.0)
    assert not led.record_hop("r", "chain", 1, "a", "b", 100, 120, "f" * 64, 1.0, 2.0)  # retried report
    assert led.record_hop("r", "final", 0, "b", "a", 100, 120, "f" * 64, 3.0, 4.0)
    assert [h["hop"] for h in led.hops("r")] == [1]
    first = led.add_event("r", "hop", "one")
    led.add_event("r", "hop", "two", site="a", n=2)
    later = led.events_after("r", first)
    assert [e["message"] for e in later] == ["two"] and later[0]["site"] == "a"
    assert led.finish_run("r", "finished", accuracy=0.5, message="run finished", test_samples=10)
    assert not led.finish_run("r", "failed", error="late", message="run failed")  # an ended run stays ended
    assert led.run("r")["status"] == "finished"
    # The terminal status and its event are written together: a watcher that stops on the status
    # (WatchRun) has the event. A GPU run's watcher once ended without "run finished".
    final = led.events_after("r", first)[-1]
    assert (final["kind"], final["message"]) == ("finished", "run finished")
    assert json.loads(final["data"]) == {"accuracy": 0.5, "test_samples": 10}
    assert [e["kind"] for e in led.events_after("r", first)].count("failed") == 0
    # Every site of the ended run is owed an end notice (Peer.EndRun) until it takes it.
    assert [(n["run_id"], n["site"], n["status"]) for n in led.pending_end_notices()] == [("r", "a", "finished")]
    led.end_notice_delivered("r", "a")
    assert led.pending_end_notices() == []


def _running(led: Ledger, names: list[str]) -> None:
    led.create_run("r", strategy="fedelmy", arch="cnn", seed=1, params={},
                   chain=[{"name": n, "address": f"127.0.0.1:{2000 + i}"} for i, n in enumerate(names)],
                   class_index=["c"], model={}, warnings=[], insecure=True, plan=chain_plan(names).to_json())


def test_a_restarted_coordinator_recomputes_the_reroutes_from_the_ledger():
    """Skips are in the ledger; the reroutes that tell the sites are recomputed at start-up (a
    restart between recording a skip and reaching the sites loses nothing), for exactly the
    sites whose route differs from the original order, at their latest registered address."""
    from fedrelay.coordinator.service import CoordinatorService

    led = Ledger(":memory:")
    _running(led, ["a", "b", "c", "d", "e"])
    led.upsert_peer("c", "10.0.0.3:7000", image_offers(), "cpu", "x")  # c came back elsewhere
    names = ["a", "b", "c", "d", "e"]
    plan = chain_plan(names)
    led.reroute("r", replan(names, 1, plan, {"b"}, plan.visits[0]).to_json(), [("b", "down")])
    service = CoordinatorService(led)
    assert service.recover() == ["r"]
    pending = {site: r for (run, site), r in service.owed.reroutes.items() if run == "r"}
    assert sorted(pending) == ["a", "c", "e"]  # e: the last site copies the final model to fewer sites

    def hops(r, **match):
        return [(t.index, t.sender, t.receiver) for t in r.transfers if t.purpose == common_pb2.CHAIN_HOP
                and all(getattr(t, k) == v for k, v in match.items())]

    assert hops(pending["a"], sender="a") == [(2, "a", "c")]
    assert {p.name: p.address for p in pending["a"].peers}["c"] == "10.0.0.3:7000"
    assert hops(pending["c"], receiver="c") == [(2, "a", "c")] and hops(pending["c"], sender="c") == [(3, "c", "d")]
    assert [t.receiver for t in pending["e"].transfers if t.purpose == common_pb2.FINAL_MODEL] == ["a", "c", "d"]
    assert {r.route_version for r in pending.values()} == {1} and list(pending["a"].skipped) == ["b"]


def test_an_old_ledger_gains_the_new_hop_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("""CREATE TABLE hops (run_id TEXT NOT NULL, purpose TEXT NOT NULL, hop INTEGER NOT NULL,
                  sender TEXT NOT NULL, receiver TEXT NOT NULL, payload_bytes INTEGER NOT NULL,
                  wire_bytes INTEGER NOT NULL, sha256 TEXT NOT NULL, started REAL NOT NULL, ended REAL NOT NULL,
                  PRIMARY KEY (run_id, purpose, hop, receiver))""")
    db.execute("INSERT INTO hops VALUES ('old', 'chain', 1, 'a', 'b', 10, 12, 'f', 1.0, 2.0)")
    db.commit()
    db.close()
    led = Ledger(path)
    assert led.hops("old")[0]["attempts"] == 1 and led.hops("old")[0]["resumed_from"] == 0
    assert led.record_hop("new", "chain", 1, "a", "b", 10, 30, "f", 1.0, 2.0, attempts=3, resumed_from=4)
    assert (led.hops("new")[0]["attempts"], led.hops("new")[0]["resumed_from"]) == (3, 4)
