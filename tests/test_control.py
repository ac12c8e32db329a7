"""Run control (docs/how-to/watch-and-steer.md): stopping a run, forgetting a peer, stale peers left out of the
default peer set, a second daemon under a live site's name refused, and retention (`peer prune`).

One real trial (a coordinator and 3 peer daemons as processes, mutual TLS, tiny data) carries the
stop, forget, duplicate-name and restart checks; the stale-peer and prune rules are checked on the
service and a made-up state dir."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from deploy import local_trial, processes
from conftest import Aborted, FakeContext, image_offers
from fedrelay.coordinator.ledger import TERMINAL, Ledger

pytestmark = pytest.mark.integration


# Long enough that the first site is still training when it is stopped (~70 images per site).
SLOW = ["--models-per-site", "3", "--local-epochs", "20", "--warmup-epochs", "20", "--batch-size", "8"]
DEADLINE = 120.0  # seconds any awaited condition may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def trial(three_sites, tmp_path_factory):
    with local_trial.LocalTrial(tmp_path_factory.mktemp("control"), three_sites[:2],
                                coordinator_args=["--peer-timeout", "8"]) as t:
        yield t


def _until(what: str, check, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _client(trial):
    from fedrelay.coordinator.client import OperatorClient

    return OperatorClient(trial.coordinator, trial.transport())


def _site_status(trial, name: str):
    from fedrelay.v1 import peer_pb2, peer_pb2_grpc

    with trial.transport("coordinator").channel(trial.addresses[name], expect=name) as ch:
        return peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=10)


def test_stop_a_run_mid_training(trial):
    waiter = subprocess.Popen([processes.tool("coordinator"), "start-chain", "--seed", "3", "--wait", "--json",
                               *SLOW, "--coordinator", trial.coordinator, *trial.security_args()],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trial.env)
    try:
        with _client(trial) as client:
            run_id = _until("the run", lambda: next((r["run_id"] for r in client.runs() if r["status"] == "running"),
                                                    None))
            # A site is training: its first epoch has been reported.
            first = next(e for e in client.watch(run_id) if e.kind == "epoch")
            training = first.site
            # A site of a running run cannot be forgotten.
            res = trial.cli("forget-peer", training, capture_output=True, text=True, timeout=60)
            assert res.returncode != 0 and f"running run(s) {run_id}" in res.stderr and "Traceback" not in res.stderr
            res = trial.cli("stop", run_id, "--reason", "wrong seed", capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            assert "cancelled by operator" in res.stdout and "wrong seed" in res.stdout
            out, err = waiter.communicate(timeout=DEADLINE)
            # --wait ends on the cancellation, with a non-zero exit code and the summary.
            assert waiter.returncode == 1, err[-2000:]
            s = json.loads(out)
            assert s["status"] == "cancelled" and s["cancelled_by"] == "operator" and s["cancel_reason"] == "wrong seed"
            assert s["ended"] >= s["created"] and s["final"] is None
            assert "run cancelled by operator: wrong seed" in err
            shown = trial.cli("show", run_id, capture_output=True, text=True, timeout=60).stdout
            assert "cancelled by operator" in shown and "wrong seed" in shown

            # Every site gets the end notice; the training one stopped at an epoch boundary.
            db = sqlite3.connect(trial.workdir / "ledger.sqlite")
            _until("the end notices", lambda: db.execute(
                "SELECT COUNT(*) FROM end_notices WHERE run_id = ? AND delivered IS NOT NULL", (run_id,)).fetchone()[0] == 2)
            states = {n: {r.run_id: r.state for r in _site_status(trial, n).runs}[run_id] for n in trial.names}
            assert states[training] == "ended", states
            assert all(st in ("ended", "done") for st in states.values()), states
            for n in trial.names:
                folder = trial.workdir / "state" / n / "runs" / run_id
                assert not list(folder.rglob("*.part")), f"partial files left at {n}"
                assert json.loads((folder / "state.json").read_text())["run_status"] == "cancelled"
            # Nothing is recorded for the run after its cancellation (the notices were delivered).
            events = list(client.watch(run_id))
            assert events[-1].kind == "cancelled", [e.message for e in events[-3:]]

            # Stopping it again, or a run that never existed: clear errors.
            with pytest.raises(grpc.RpcError) as again:
                client.stop(run_id)
            assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "already ended (cancelled" in again.value.details()
            with pytest.raises(grpc.RpcError) as unknown:
                client.stop("20990101-000000-abcdef")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "unknown run" in unknown.value.details()

        # The daemons go on serving.
        assert all(_site_status(trial, n).name == n for n in trial.names)
        # Retention at a site, while its daemon runs: the cancelled run goes (dry run first).
        state = trial.workdir / "state" / trial.names[0]
        peer = [processes.tool("peer"), "prune", "--state-dir", str(state), "--older-than", "0"]
        dry = subprocess.run([*peer, "--dry-run"], capture_output=True, text=True, timeout=60, env=trial.env)
        assert dry.returncode == 0 and f"would remove run {run_id} (cancelled" in dry.stdout
        assert (state / "runs" / run_id).is_dir()
        real = subprocess.run(peer, capture_output=True, text=True, timeout=60, env=trial.env)
        assert real.returncode == 0 and f"removed run {run_id}" in real.stdout and "removed 1 run(s)" in real.stdout
        assert not (state / "runs" / run_id).exists()
        assert _site_status(trial, trial.names[0]).name == trial.names[0]
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()


def test_forget_peer_holds_against_the_daemon_still_running(trial):
    """A forgotten site's daemon keeps heartbeating; its heartbeats are refused (it used to
    register again at the next one, undoing the operator's forget-peer)."""
    name = trial.names[0]
    res = trial.cli("forget-peer", name, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"forgot peer {name}" in res.stdout and "refused from now on" in res.stdout
    unknown = trial.cli("forget-peer", "no-such-site", capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and "no peer named 'no-such-site'" in unknown.stderr
    _until("the refused heartbeat", lambda: "removed by the coordinator's operator (forget-peer)"
           in (trial.logs / f"{name}.log").read_text(errors="replace"))
    with _client(trial) as client:
        assert name not in {p.name for p in client.peers()}


def test_a_second_daemon_under_a_live_name_is_refused(trial, tmp_path):
    """`peer serve` in this process (no second interpreter to start): it exits with the message."""
    import signal

    from typer.testing import CliRunner

    from fedrelay.cli.peer import app

    name = trial.names[1]
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        second = CliRunner().invoke(app, [
            "serve", "--data", str(trial.site_dirs[1]), "--name", name, "--listen",
            f"127.0.0.1:{processes.free_port()}", "--coordinator", trial.coordinator,
            "--state-dir", str(tmp_path / "second"), "--tls", str(trial.site_tls(name)), "--device", "cpu"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert second.exit_code == 1, second.output
    assert f"already served by a live daemon at {trial.addresses[name]}" in " ".join(second.output.split())
    assert second.exception is None or isinstance(second.exception, SystemExit)
    assert "refused the registration" in (trial.logs / "coordinator.log").read_text()
    with _client(trial) as client:
        assert {p.name: p.address for p in client.peers()}[name] == trial.addresses[name]


# -- the rules on their own --------------------------------------------------------------------------


def _peers(ledger: Ledger, names: list[str], stale: list[str]) -> None:
    for n in names:
        ledger.upsert_peer(n, f"127.0.0.1:{9000 + len(n)}", image_offers({"c": (5, 1)}),
                           "cpu", "x")
    for n in stale:
        ledger.store.exec("UPDATE peers SET last_seen = ? WHERE name = ?", (time.time() - 600, n))


PARAMS = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0, lr=1e-3,
              batch_size=8, weight_decay=0.0, selection="best-val")


def test_stale_peers_are_left_out_of_the_default_set_and_refused_by_name():
    from fedrelay import params as run_params
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.v1 import coordinator_pb2 as cpb

    ledger = Ledger(":memory:")
    _peers(ledger, ["a", "b", "c"], stale=["b"])
    service = CoordinatorService(ledger, peer_timeout=120)
    warnings: list[str] = []
    kept = service.runs.fresh_peers([], warnings)
    assert [p["name"] for p in kept] == ["a", "c"]
    assert len(warnings) == 1 and "stale" in warnings[0] and "b (last seen 600 s ago)" in warnings[0]
    with pytest.raises(Aborted) as err:
        service.StartChain(cpb.StartChainRequest(peers=["a", "b"], seed=1), FakeContext())
    assert err.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale peers" in err.value.args[1] and "b (last seen" in err.value.args[1]
    # With only one live peer left, the refusal says why.
    _peers(ledger, [], stale=["c"])
    with pytest.raises(Aborted) as err:
        service.StartChain(cpb.StartChainRequest(seed=1, params=run_params.to_pb(PARAMS)), FakeContext())
    assert "at least 2 sites" in err.value.args[1] and "left out 2 stale peer(s)" in err.value.args[1]


def test_the_ledger_cancels_only_running_runs_and_forgets_peers():
    from fedrelay.coordinator.plan import chain_plan

    assert "cancelled" in TERMINAL
    ledger = Ledger(":memory:")
    ledger.create_run("r", strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in ("a", "b")], class_index=["x"],
                      model={}, warnings=[], insecure=True, plan=chain_plan(["a", "b"]).to_json())
    assert ledger.cancel_run("r", "insecure operator", "because")
    run = ledger.run("r")
    assert (run["status"], run["cancelled_by"], run["cancel_reason"]) == ("cancelled", "insecure operator", "because")
    assert not ledger.cancel_run("r", "someone else", "again")
    assert ledger.run("r")["cancelled_by"] == "insecure operator"
    assert {n["site"] for n in ledger.pending_end_notices()} == {"a", "b"}
    assert ledger.events_after("r", 0)[-1]["kind"] == "cancelled"
    _peers(ledger, ["a"], stale=[])
    assert ledger.forget_peer("a") and ledger.peer("a") is None and not ledger.forget_peer("a")


def _run_folder(runs: Path, run_id: str, doc: dict, age_days: float, size: int = 100) -> Path:
    folder = runs / run_id
    (folder / "pool").mkdir(parents=True)
    (folder / "pool" / "model-1.safetensors").write_bytes(b"x" * size)
    (folder / "state.json").write_text(json.dumps(doc))
    old = time.time() - age_days * 86_400
    os.utime(folder / "state.json", (old, old))
    return folder


def test_prune_removes_only_ended_runs_older_than_the_limit(tmp_path):
    from typer.testing import CliRunner

    from fedrelay.cli.peer import app

    runs = tmp_path / "state" / "runs"
    now = time.time()
    old_done = _run_folder(runs, "old-finished", {"state": "done", "run_status": "finished",
                                                   "run_ended": now - 5 * 86_400}, 5, size=1000)
    old_cancelled = _run_folder(runs, "old-cancelled", {"state": "ended", "run_status": "cancelled",
                                                         "run_ended": now - 3 * 86_400}, 3, size=10)
    recent = _run_folder(runs, "recent-failed", {"state": "failed", "run_status": "failed", "run_ended": now}, 0)
    running = _run_folder(runs, "old-running", {"state": "training"}, 30)
    done_no_notice = _run_folder(runs, "old-done-no-notice", {"state": "done"}, 30)  # may still run elsewhere
    legacy = _run_folder(runs, "old-legacy-failed", {"state": "failed"}, 30, size=1)
    removed_bytes = sum(p.stat().st_size for f in (old_done, old_cancelled, legacy) for p in f.rglob("*") if p.is_file())
    cli = CliRunner()
    args = ["prune", "--state-dir", str(tmp_path / "state"), "--older-than", "2"]
    dry = cli.invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would remove 3 run(s)" in dry.output and "would remove run old-finished (finished" in dry.output
    assert all(f.exists() for f in (old_done, old_cancelled, recent, running, done_no_notice, legacy))
    real = cli.invoke(app, args)
    assert real.exit_code == 0, real.output
    gone = (old_done, old_cancelled, legacy)
    assert not any(f.exists() for f in gone) and all(f.exists() for f in (recent, running, done_no_notice))
    assert f"removed 3 run(s), {removed_bytes:,} bytes; kept 3" in real.output
    bad = cli.invoke(app, ["prune", "--state-dir", str(tmp_path / "nothing"), "--older-than", "1"])
    assert bad.exit_code == 2 and "not a peer's state dir" in bad.output
    neg = cli.invoke(app, [*args[:-1], "-1"])
    assert neg.exit_code == 2 and ">= 0 days" in neg.output


def test_a_run_pruned_while_the_daemon_runs_leaves_its_status(three_sites, tmp_path):
    """``peer prune`` works on the files; the running daemon's status then no longer lists the
    pruned run (an active run is never pruned, and stays listed)."""
    import shutil

    from tests.test_transfer import assignment

    from fedrelay.tasks.image_folder.data import load_site
    from fedrelay.peer.node import PeerNode

    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    node.assign(assignment("r1"))
    node.assign(assignment("r2"))
    assert [r.run_id for r in node.status().runs] == ["r1", "r2"]
    node.runs["r1"].state = "done"
    shutil.rmtree(node.runs["r1"].folder)
    shutil.rmtree(node.runs["r2"].folder)  # (not something prune does to an active run)
    assert [r.run_id for r in node.status().runs] == ["r2"] and "r1" not in node.runs


class FakePeer:
    """A Peer service that answers GetStatus only, as a daemon named ``name`` of ``instance``."""

    def __init__(self, name: str, instance: str):
        from fedrelay.server import make_server
        from fedrelay.transport import INSECURE
        from fedrelay.v1 import peer_pb2, peer_pb2_grpc

        class Servicer(peer_pb2_grpc.PeerServicer):
            def GetStatus(self, request, context):
                return peer_pb2.PeerStatus(name=name, instance=instance)

        self.server, port = make_server("127.0.0.1:0", transport=INSECURE)
        peer_pb2_grpc.add_PeerServicer_to_server(Servicer(), self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"


def test_a_name_is_refused_only_while_its_daemon_answers_and_a_restart_takes_it_over():
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.v1 import coordinator_pb2 as cpb

    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)

    def register(address: str, instance: str):
        return service.Register(cpb.RegisterRequest(name="a", address=address, instance=instance), FakeContext())

    live = FakePeer("a", "first")
    try:
        register(live.address, "first")
        register(live.address, "first")  # a heartbeat
        with pytest.raises(Aborted) as err:
            register("127.0.0.1:9", "second")
        assert err.value.args[0] == grpc.StatusCode.ALREADY_EXISTS and live.address in err.value.args[1]
        assert ledger.peer("a")["address"] == live.address and ledger.peer("a")["instance"] == "first"
    finally:
        live.server.stop(None).wait()
    # The first daemon is gone (a crash): a new one takes the name over, on another port.
    moved = f"127.0.0.1:{processes.free_port()}"
    register(moved, "second")
    assert (ledger.peer("a")["address"], ledger.peer("a")["instance"]) == (moved, "second")
    # Another daemon answers at the registered address, as another instance (the port was reused).
    other = FakePeer("a", "third")
    try:
        ledger.upsert_peer("a", other.address, image_offers(), "cpu", "x")
        register("127.0.0.1:10", "fourth")
        assert ledger.peer("a")["instance"] == "fourth"
    finally:
        other.server.stop(None).wait()
    service.close()


def test_stopping_a_finished_run_is_refused_and_a_cancel_is_recorded_with_who():
    from fedrelay.coordinator.plan import chain_plan
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.v1 import coordinator_pb2 as cpb

    ledger = Ledger(":memory:")
    for run_id in ("done", "live"):
        ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={},
                          chain=[{"name": n, "address": "127.0.0.1:9"} for n in ("a", "b")], class_index=["x"],
                          model={}, warnings=[], insecure=True, plan=chain_plan(["a", "b"]).to_json())
    ledger.finish_run("done", "finished", accuracy=0.5, message="run finished")
    service = CoordinatorService(ledger)
    with pytest.raises(Aborted) as err:
        service.StopRun(cpb.StopRunRequest(run_id="done"), FakeContext())
    assert err.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION and "already ended (finished" in err.value.args[1]
    s = service.StopRun(cpb.StopRunRequest(run_id="live", reason="r"), FakeContext())
    assert (s.status, s.cancelled_by, s.cancel_reason) == ("cancelled", "insecure operator", "r") and s.ended > 0
    # Reports that arrive after the cancellation are not recorded.
    before = len(ledger.events_after("live", 0))
    reply = service.ReportProgress(cpb.ProgressReport(run_id="live", site="a", kind="state", state="training"),
                                   FakeContext())
    assert reply.duplicate and len(ledger.events_after("live", 0)) == before


def test_a_send_stops_at_the_next_chunk_once_cancelled(tmp_path):
    """``send_model(cancelled=...)``: the sender gives the stream up at a chunk boundary; the
    receiver sees it break before the payload's end."""
    import hashlib

    from fedrelay.server import make_server
    from fedrelay.peer.transfer import SendCancelled, add_peer_servicer, send_model
    from fedrelay.v1 import common_pb2, peer_pb2, peer_pb2_grpc

    got, broke = [], threading.Event()
    asked = []

    def cancelled() -> bool:  # asked before each data chunk: stop before the third
        asked.append(1)
        return len(asked) > 2

    class Receiver(peer_pb2_grpc.PeerServicer):
        def TransferOffset(self, request, context):
            return peer_pb2.TransferOffsetReply(offset=0)

        def Handoff(self, chunks, context):
            for chunk in chunks:
                got.append(chunk)
            broke.set()  # the stream ended short of the payload: refused, as a real receiver does
            context.abort(grpc.StatusCode.DATA_LOSS, "the stream ended early")

    server, port = make_server("127.0.0.1:0")
    add_peer_servicer(Receiver(), server)
    server.start()
    try:
        payload = tmp_path / "model.safetensors"
        payload.write_bytes(os.urandom(8 << 20))  # 8 chunks of 1 MiB
        header = common_pb2.TransferHeader(run_id="r", hop=1, sender="a", total_bytes=8 << 20,
                                           sha256=hashlib.sha256(payload.read_bytes()).hexdigest())
        with pytest.raises(SendCancelled):
            send_model(f"127.0.0.1:{port}", header, payload, cancelled=cancelled)
        assert broke.wait(10)
        assert len(asked) >= 3 and len(got) <= 3  # the header and at most 2 of the 8 chunks
    finally:
        server.stop(None).wait()
