"""Watching a run: ``coordinator watch``, each site's live state in ``show``, ``metrics``,
``runs`` with times, ``peers --json`` with liveness; the bookkeeping alone, then once through
real daemons (a coordinator and 3 peers over mutual TLS)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import time

import grpc
import pytest
import typer

from conftest import image_offers
from fedrelay.coordinator.client import METRIC_FIELDS, OperatorClient, metric_dict, planned_epochs, summary_dict
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.live import SiteNow, apply
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb

pytestmark = pytest.mark.integration

# -- the bookkeeping, without daemons --------------------------------------------------------------


def fold(*events, models_per_site=5) -> dict[str, SiteNow]:
    sites: dict[str, SiteNow] = {}
    for i, (kind, site, data) in enumerate(events):
        apply(sites, {"kind": kind, "site": site, "time": 100.0 + i, "data": json.dumps(data)}, models_per_site)
    return sites


def test_live_state_follows_a_sites_states_and_epochs():
    s = fold(("state", "site-3", {"state": "assigned", "detail": "waiting for hop 2 from site-1"}))["site-3"]
    assert (s.state, s.activity, s.line) == ("assigned", "waiting", "site-3 waiting for hop 2 from site-1")
    assert fold(("state", "site-3", {"state": "assigned", "detail": ""}))["site-3"].line == "site-3 waiting"
    sites = fold(("state", "site-3", {"state": "receiving", "detail": "hop 2 from site-1"}),
                 ("state", "site-3", {"state": "training", "detail": ""}),
                 ("epoch", "site-3", {"stage": "warmup", "model": 0, "epoch": 1, "epochs": 2}))
    assert sites["site-3"].line == "site-3 training, warm-up, epoch 1/2"
    events = [("state", "site-3", {"state": "training", "detail": ""}),
              ("epoch", "site-3", {"stage": "pool", "model": 2, "epoch": 3, "epochs": 10})]
    s = fold(*events)["site-3"]
    assert (s.busy, s.stage, s.model, s.models, s.epoch, s.epochs) == (True, "pool", 2, 5, 3, 10)
    assert s.line == "site-3 training, model 2/5, epoch 3/10" and s.updated == 101.0
    # An upload arriving meanwhile (receiving, then the same training again) keeps the progress ...
    s = fold(*events, ("state", "site-3", {"state": "receiving", "detail": "upload 2 from site-1"}),
             ("state", "site-3", {"state": "training", "detail": ""}))["site-3"]
    assert s.line == "site-3 training, model 2/5, epoch 3/10"
    # ... another state clears it; so does a new training (the next round).
    s = fold(*events, ("state", "site-3", {"state": "sending", "detail": "hop 3 to site-4"}))["site-3"]
    assert (s.busy, s.epoch, s.line) == (True, 0, "site-3 sending (hop 3 to site-4)")
    s = fold(*events, ("state", "site-3", {"state": "training", "detail": "round 2"}))["site-3"]
    assert (s.epoch, s.line) == (0, "site-3 training, round 2")
    # A star plan's aggregator: waiting for uploads, then aggregating with epochs of its own.
    sites = fold(("state", "agg", {"state": "receiving", "detail": "1 of 2 uploads"}),
                 ("state", "agg", {"state": "training", "detail": "aggregating 3 models (ofasd)"}),
                 ("epoch", "agg", {"stage": "aggregate", "model": 0, "epoch": 1, "epochs": 2}),
                 ("skip", "gone", {}), ("evaluated", "done", {"accuracy": 0.5}),
                 ("hop", "agg", {}), ("state", "", {"state": "x"}))
    assert sites["agg"].activity == "aggregating"
    assert sites["agg"].line == "agg aggregating 3 models (ofasd), epoch 1/2"
    assert fold(("state", "agg", {"state": "receiving", "detail": "1 of 2 uploads"}))["agg"].line == \
        "agg waiting for uploads (1 of 2 arrived)"
    assert (sites["gone"].activity, sites["gone"].busy) == ("routed around", False)
    assert sites["done"].line == "done evaluated the final model (accuracy 0.5000)"
    assert set(sites) == {"agg", "gone", "done"}


class Context:
    """A server call's context on a plaintext coordinator: no identity; abort raises."""

    def auth_context(self):
        return {}

    def abort(self, code, details):
        raise grpc.RpcError(code, details)


def service_with_run(ledger: Ledger, **kw) -> CoordinatorService:
    from fedrelay import params as run_params
    from fedrelay.v1 import common_pb2

    params = run_params.to_dict(common_pb2.TrainingParams(strategy="fedelmy", models_per_site=5, local_epochs=10))
    ledger.create_run("r1", strategy="fedelmy", arch="cnn", seed=1, params=params,
                      chain=[{"name": "site-1", "address": "x:1"}, {"name": "site-3", "address": "x:3"}],
                      class_index=["c"], model={}, warnings=[], insecure=True)
    return CoordinatorService(ledger, **kw)


def test_show_has_each_sites_live_state_while_running_also_after_a_restart(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    svc = service_with_run(ledger)
    ctx = Context()
    svc.ReportProgress(cpb.ProgressReport(run_id="r1", site="site-3", kind="state", state="training"), ctx)
    svc.ReportProgress(cpb.ProgressReport(run_id="r1", site="site-3", kind="epoch", stage="pool", model=2, epoch=3,
                                          epochs=10, train_loss=0.5, val_accuracy=-1.0, seconds=1.5), ctx)
    svc.ReportProgress(cpb.ProgressReport(run_id="r1", site="site-1", kind="state", state="done"), ctx)
    live = summary_dict(svc.GetRun(cpb.GetRunRequest(run_id="r1"), ctx))["live"]
    assert [v["site"] for v in live] == ["site-1", "site-3"]  # the run's order
    assert live[1]["line"] == "site-3 training, model 2/5, epoch 3/10" and live[1]["busy"]
    assert (live[0]["state"], live[0]["busy"]) == ("done", False)
    # A restarted coordinator rebuilds it from the ledger's events.
    again = CoordinatorService(ledger)

    def without_age(rows):
        assert all(0 <= r["age_seconds"] < 60 for r in rows)
        return [{k: v for k, v in r.items() if k != "age_seconds"} for r in rows]

    assert without_age(summary_dict(again.GetRun(cpb.GetRunRequest(run_id="r1"), ctx))["live"]) == without_age(live)
    # Metrics: the ledger's rows, val_accuracy null where the site has no validation split.
    rows = [metric_dict(m) for m in again.GetMetrics(cpb.GetRunRequest(run_id="r1"), ctx).rows]
    assert rows == [{"site": "site-3", "stage": "pool", "model": 2, "epoch": 3, "epochs": 10,
                                   "train_loss": 0.5, "val_accuracy": None, "seconds": 1.5,
                                   "time": pytest.approx(time.time(), abs=60)}]
    with pytest.raises(grpc.RpcError):
        again.GetMetrics(cpb.GetRunRequest(run_id="nope"), ctx)
    # Once the run has ended there is no live state.
    ledger.finish_run("r1", "failed", error="x", message="run failed")
    assert summary_dict(again.GetRun(cpb.GetRunRequest(run_id="r1"), ctx))["live"] == []
    assert again.live._runs == {}


def test_peers_are_live_or_stale_by_the_coordinators_peer_timeout():
    ledger = Ledger(":memory:")
    svc = CoordinatorService(ledger, peer_timeout=30.0)
    for name in ("fresh", "old"):
        ledger.upsert_peer(name, "127.0.0.1:1", image_offers({"c": (5, 1)}), "cpu", "0")
    ledger.store.exec("UPDATE peers SET last_seen = ? WHERE name = 'old'", (time.time() - 45,))
    from fedrelay.coordinator.client import peer_dict

    peers = {p["name"]: p for p in map(peer_dict, svc.ListPeers(cpb.ListPeersRequest(), Context()).peers)}
    assert peers["fresh"]["live"] and peers["fresh"]["age_seconds"] < 30
    assert not peers["old"]["live"] and 44 < peers["old"]["age_seconds"] < 60
    assert peers["old"]["peer_timeout"] == 30.0 and peers["old"]["tasks"][0]["train_samples"] == 5


def test_the_progress_bar_counts_the_epochs_the_run_trains():
    def s(strategy, n=3, rounds=1, **p):
        params = {"models_per_site": 5, "local_epochs": 2, "warmup_epochs": 2, "ofasd_epochs": 3, **p}
        return {"strategy": strategy, "order": ["a"] * n, "rounds": rounds, "params": params}

    assert planned_epochs(s("fedelmy")) == 2 + 10 * 3
    assert planned_epochs(s("fedseq", rounds=2)) == 2 + 10 * 3 * 2
    assert planned_epochs(s("fedavg")) == (2 + 10) * 3
    assert planned_epochs(s("ofasd")) == (2 + 10) * 3 + 3


def test_watching_an_ended_run_prints_its_summary_at_once(capsys):
    from fedrelay.cli.coordinator import watch_view

    class Client:
        def __init__(self, status):
            self.summary = summary_dict(cpb.RunSummary(run_id="r1", strategy="fedseq", order=["a", "b"], status=status,
                                                       error="a: boom" if status == "failed" else "", rounds=1))

        def run(self, run_id):
            return self.summary

        def follow(self, *a, **kw):
            raise AssertionError("an ended run is not followed")

    with pytest.raises(typer.Exit) as ended:
        watch_view(Client("failed"), "r1", "x:1", as_json=False)
    assert ended.value.exit_code == 1
    out = capsys.readouterr().out
    assert "run r1" in out and "failed" in out and "a: boom" in out
    watch_view(Client("finished"), "r1", "x:1", as_json=True)  # exit code 0: returns
    assert json.loads(capsys.readouterr().out)["status"] == "finished"

    class Unknown(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "unknown run 'r9'"

    class Nothing:
        def run(self, run_id):
            raise Unknown()

    with pytest.raises(typer.Exit) as ended:
        watch_view(Nothing(), "r9", "x:1", as_json=False)
    assert ended.value.exit_code == 2 and "unknown run 'r9'" in capsys.readouterr().err


def test_follow_reconnects_from_the_last_event_seen():
    class Lost(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    class Client(OperatorClient):
        """The coordinator goes away after event 2 of the first stream, then comes back."""

        def __init__(self):
            self.asked = []

        def watch(self, run_id, after_seq=0):
            self.asked.append(after_seq)
            events = [cpb.RunEvent(seq=1, kind="epoch"), cpb.RunEvent(seq=2, kind="hop"),
                      cpb.RunEvent(seq=3, kind="finished"), cpb.RunEvent(seq=4, kind="state")]
            if after_seq == 0:
                yield from events[:2]
                raise Lost()
            yield from (e for e in events if e.seq > after_seq)

    client, lost = Client(), []
    assert [e.seq for e in client.follow("r", retry_every=0, on_reconnect=lost.append)] == [1, 2, 3]  # ends there
    assert client.asked == [0, 2] and len(lost) == 1
    with pytest.raises(grpc.RpcError):  # gone for longer than reconnect_for
        list(Client().follow("r", retry_every=0, reconnect_for=-1))


# -- through real daemons ----------------------------------------------------------------------------

CHAIN = ["--models-per-site", "2", "--local-epochs", "2", "--warmup-epochs", "2", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trial(three_sites, tmp_path_factory):
    from deploy import local_trial

    with local_trial.LocalTrial(tmp_path_factory.mktemp("watching"), three_sites) as t:
        yield t


def cli(trial, *argv: str) -> str:
    res = trial.cli(*argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return res.stdout


def test_watch_show_metrics_runs_and_peers_of_a_real_run(trial):
    run_id = json.loads(cli(trial, "start-chain", "--seed", "4", "--json", *CHAIN))["run_id"]
    # The first epoch event of the run's first site: stop that site's daemon (SIGSTOP) so that
    # it stays in the middle of its training while we look at it, then let it go on.
    with OperatorClient(trial.coordinator, trial.transport()) as client:
        events = client.follow(run_id)
        first = next(ev for ev in events if ev.kind == "epoch")
        events.close()
    frozen = trial.procs[first.site]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while True:
            shown = json.loads(cli(trial, "show", run_id, "--json"))
            live = {v["site"]: v for v in shown["live"]}
            if live.get(first.site, {}).get("epoch"):
                break
            assert time.monotonic() < deadline, shown["live"]
        assert shown["status"] == "running"
        now = live[first.site]
        assert (now["state"], now["activity"], now["busy"]) == ("training", "training", True)
        assert now["line"].startswith(f"{first.site} training, ") and f"epoch {now['epoch']}/" in now["line"]
        assert now["stage"] in ("warmup", "pool") and now["epochs"] == 2
        waiting = [v for v in shown["live"] if v["site"] == shown["order"][1]]
        assert waiting and waiting[0]["activity"] == "waiting"
        text = cli(trial, "show", run_id)
        assert "now:" in text and f"{first.site} training" in text
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # Re-attach to the live run: the view of start-chain --wait, its summary as JSON at the end.
    res = trial.cli("watch", run_id, "--json", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["status"] == "finished" and summary["live"] == []
    assert "hop 2:" in res.stderr and "run finished" in res.stderr  # the live view went to stderr
    # Watching the finished run prints its summary at once (no event lines).
    text = cli(trial, "watch", run_id)
    assert f"run {run_id}" in text and "finished" in text and "global" in text and "hop 1:" not in text

    # Metrics: every epoch of every site, per pool model.
    rows = json.loads(cli(trial, "metrics", run_id, "--json"))
    order = summary["order"]
    got = {(r["site"], r["stage"], r["model"], r["epoch"]) for r in rows}
    want = {(order[0], "warmup", 0, e) for e in (1, 2)} | {(s, "pool", m, e) for s in order for m in (1, 2)
                                                           for e in (1, 2)}
    assert got == want and len(rows) == len(want)
    assert all(r["epochs"] == 2 and r["train_loss"] > 0 and r["seconds"] > 0 for r in rows)
    table = list(csv.DictReader(io.StringIO(cli(trial, "metrics", run_id, "--csv", "--site", order[1]))))
    assert list(table[0]) == list(METRIC_FIELDS) and len(table) == 4
    assert {(r["site"], r["model"], r["epoch"]) for r in table} == {(order[1], str(m), str(e)) for m in (1, 2)
                                                                      for e in (1, 2)}
    res = trial.cli("metrics", run_id, "--site", "nowhere", capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "nowhere" in res.stderr and "Traceback" not in res.stderr
    # Only the operator may read them.
    from fedrelay.transport import Transport

    site = Transport.from_dir(trial.site_tls(order[0]))
    with site.channel(trial.coordinator, expect="coordinator") as ch, pytest.raises(grpc.RpcError) as err:
        from fedrelay.v1 import coordinator_pb2_grpc

        coordinator_pb2_grpc.CoordinatorStub(ch).GetMetrics(cpb.GetRunRequest(run_id=run_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # runs: created and ended, in local time.
    text = cli(trial, "runs")
    assert run_id in text and time.strftime("%Y-%m-%d", time.localtime(summary["created"])) in text
    # peers --json: every site live, with its last heartbeat; the table keeps whole names.
    peers = json.loads(cli(trial, "peers", "--json"))
    assert sorted(p["name"] for p in peers) == trial.names
    assert all(p["live"] and 0 <= p["age_seconds"] < p["peer_timeout"] for p in peers)
    assert all(abs(time.time() - p["last_seen"] - p["age_seconds"]) < 30 for p in peers)
    text = cli(trial, "peers")
    assert all(any(n in line and "live" in line for line in text.splitlines()) for n in trial.names)
    assert all(trial.addresses[n] in text for n in trial.names)
