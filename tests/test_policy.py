"""A site's own policy and more than one operator (docs/site-policy.md).

Unit tests of the policy file (every bad key named, no traceback); then a coordinator and three
peer daemons in this process over mutual TLS, the middle site with a policy file that each test
rewrites while the daemon runs: an assignment outside the policy (task, digest, strategy,
epochs, operator, the pause switch, a broken file) fails the run before any model moves, and
`coordinator show` (and --json) names the site and its reason; an allowed run started by a
second operator finishes; who started and who stopped each run is in the ledger."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from fedrelay import params as run_params
from fedrelay.callers import is_operator
from fedrelay.transport import Transport
from fedrelay.cli.coordinator import app as coordinator_app
from fedrelay.cli.peer import app as peer_app
from fedrelay.coordinator import pki
from fedrelay.peer import policy
from fedrelay.v1 import peer_pb2
from conftest import flat, serve_in_threads, stop_threads

pytestmark = pytest.mark.integration

PARAMS = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=1, alpha=1.0, beta=1.0, lr=1e-3,
              batch_size=32, weight_decay=0.0, selection="best-val")


# -- the policy file ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("acept_runs = false", "unknown key 'acept_runs'"),
    ("accept_runs = 0", "accept_runs must be true or false"),
    ('strategies = "fedelmy"', "strategies must be a list of names"),
    ('strategies = ["fedelmy", "fedsq"]', "strategies: unknown strategy 'fedsq'"),
    ("operators = [1]", "operators must be a list of names"),
    ("[limits]\nlocal_epoch = 3", "unknown key 'limits.local_epoch'"),
    ("[limits]\nlocal_epochs = -1", "limits.local_epochs must be a whole number >= 0"),
    ("[limits]\nrounds = 2.5", "limits.rounds must be a whole number >= 0"),
    ('[tasks]\nimage-folder = ["abc"]', "tasks.image-folder must be SHA-256s"),
    ("[tasks]\nimage-folder = 3", "tasks.image-folder must be a list of code SHA-256s"),
    ("tasks = 3", "tasks must be a table"),
    ("accept_runs = ", "not valid TOML"),
])
def test_a_bad_policy_file_is_a_clear_message_naming_the_key(tmp_path, text, words):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(policy.PolicyError, match="policy.toml") as err:
        policy.load(path)
    assert words in str(err.value)
    with pytest.raises(policy.PolicyError, match=words.replace("(", r"\(").replace(")", r"\)")):
        policy.SitePolicy.at(path, tmp_path)  # the daemon refuses to start with it
    # `peer serve --check --policy FILE` says so in one line, without a traceback.
    res = CliRunner().invoke(peer_app, ["serve", "--check", "--data", str(tmp_path), "--name", "site-x",
                                        "--insecure", "--policy", str(path), "--state-dir", str(tmp_path / "s")])
    assert res.exit_code != 0 and words in " ".join(res.output.split()) and "Traceback" not in res.output, res.output


def test_no_policy_file_restricts_nothing_and_a_named_one_must_exist(tmp_path):
    assert policy.SitePolicy.at(None, tmp_path).current() is None  # STATE_DIR/policy.toml absent
    with pytest.raises(policy.PolicyError, match="is missing"):
        policy.SitePolicy.at(tmp_path / "nope.toml", tmp_path)
    a = peer_pb2.Assignment(run_id="r", rounds=3, operator="operator.bob")
    a.params.strategy, a.params.local_epochs = "fedseq", 100
    a.model.task = "anything"
    policy.SitePolicy.at(None, tmp_path).check(a)  # no policy: accepted
    policy.parse("").check(a)  # an empty policy: accepted too


def test_the_operator_identities():
    assert is_operator("operator") and is_operator("operator.alice")
    assert not any(map(is_operator, ("", None, "operator.", "site-a", "coordinator", "operators")))
    assert pki.operator_identity("alice") == "operator.alice"
    for bad in ("Alice", "operator", "a.b", ""):
        with pytest.raises(pki.PKIError):
            pki.operator_identity(bad)


def test_enroll_operator_says_what_is_wrong(tmp_path):
    pki.init_ca(tmp_path / "pki")
    runner = CliRunner()
    for args, words in ((["Bob"], "--operator: "), (["operator"], "reserved"), (["bob", "--kit"], "--kit")):
        res = runner.invoke(coordinator_app, ["enroll", "--operator", *args, "--ca", str(tmp_path / "pki"),
                                              "--out", str(tmp_path / "out")])
        assert res.exit_code != 0 and words in flat(res.output) and "Traceback" not in res.output, res.output
    res = runner.invoke(coordinator_app, ["enroll", "bob", "--operator", "--ca", str(tmp_path / "pki"),
                                          "--out", str(tmp_path / "bob")])
    assert res.exit_code == 0, res.output
    assert Transport.from_dir(tmp_path / "bob").identity == "operator.bob"


def test_a_site_that_connects_out_only_answers_the_policy_check_over_its_control_stream(tmp_path):
    """CheckPolicy goes over the control stream like Assign: the refusal reaches the
    coordinator's tunnel as the same PERMISSION_DENIED, and reads as the site policy's."""
    from types import SimpleNamespace

    from fedrelay.coordinator.site_policy import first_refusal
    from fedrelay.coordinator.tunnel_server import Tunnels
    from fedrelay.peer.tunnel_client import answer
    from fedrelay.peer.servicer import PeerServicer
    from fedrelay.v1 import coordinator_pb2 as cpb

    (tmp_path / "policy.toml").write_text('strategies = ["fedelmy"]\n')
    servicer = PeerServicer(SimpleNamespace(name="site-b", policy=policy.SitePolicy.at(None, tmp_path)))
    from test_transfer import assignment

    a = assignment("r1")
    a.operator, a.params.strategy = "operator", "fedseq"
    tunnels = Tunnels()
    tunnel = tunnels.open("site-b", "i1")

    def site() -> None:
        request = tunnel.outbox.get(timeout=10)
        for reply in answer(servicer, request, secure=True):
            tunnel.deliver(reply)

    threading.Thread(target=site, daemon=True).start()
    assert first_refusal([("site-b", tunnels.stub("site-b"), a)], timeout=10) == \
        ("site-b", "strategy 'fedseq' is not accepted here (strategies: fedelmy)")
    a.params.strategy = "fedelmy"
    threading.Thread(target=site, daemon=True).start()
    assert first_refusal([("site-b", tunnels.stub("site-b"), a)], timeout=10) is None


# -- through the daemons ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(three_sites, tmp_path_factory):
    """A coordinator and three peer daemons over mutual TLS; the middle site serves with
    ``--policy POLICY`` (a file the tests rewrite). Two operators: ``operator`` (init-ca) and
    ``operator.alice`` (enrolled with the CLI's ``enroll --operator alice``)."""
    from fedrelay.coordinator.client import OperatorClient

    root = tmp_path_factory.mktemp("policy")
    pki.init_ca(root / "pki")
    res = CliRunner().invoke(coordinator_app, ["enroll", "--operator", "alice", "--ca", str(root / "pki"),
                                               "--out", str(root / "alice")])
    assert res.exit_code == 0 and "operator.alice" in res.output, res.output
    names = [d.name for d in three_sites]
    tls = {n: pki.enroll(n, root / "pki", root / f"{n}.pki") for n in names}
    rules = root / "policy.toml"
    rules.write_text('strategies = ["fedelmy"]\n')
    address, daemons = serve_in_threads(root, three_sites, tls, **{names[1]: {"policy": rules}})
    ops = {"operator": OperatorClient(address, Transport.from_dir(root / "pki" / "operator")),
           "operator.alice": OperatorClient(address, Transport.from_dir(root / "alice"))}
    try:
        while {p.name for p in ops["operator"].peers()} != set(names):
            time.sleep(0.1)
        yield dict(address=address, root=root, names=names, rules=rules, ops=ops, state=root / "state")
    finally:
        for c in ops.values():
            c.close()
        stop_threads(daemons)


def write_policy(world, text: str) -> None:
    """Replace the middle site's policy file while its daemon runs (a new file: a new inode)."""
    tmp = world["rules"].with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, world["rules"])


def start(world, operator: str = "operator", **params):
    return world["ops"][operator].start_chain(peers=world["names"], order="given", seed=1, model="cnn",
                                              params=run_params.to_pb({**PARAMS, **params}))


def cli(world, *args: str, operator: str = "operator"):
    tls = world["root"] / ("pki/operator" if operator == "operator" else "alice")
    return CliRunner().invoke(coordinator_app, [*args, "--coordinator", world["address"], "--tls", str(tls)])


REFUSALS = {  # policy text, run params, the reason's words
    "strategy": ('strategies = ["fedelmy"]', dict(strategy="fedseq"), "strategy 'fedseq' is not accepted here"),
    "local epochs": ("[limits]\nlocal_epochs = 1", dict(local_epochs=2),
                     "--local-epochs (E) 2 is more than this site accepts (limits.local_epochs = 1)"),
    "warm-up epochs": ("[limits]\nwarmup_epochs = 0", {}, "--warmup-epochs (Ew) 1 is more than this site accepts"),
    "models per site": ("[limits]\nmodels_per_site = 1", dict(models_per_site=2),
                        "--models-per-site (S) 2 is more than this site accepts"),
    "task": ('[tasks]\ntabular-csv = "*"', {}, "task 'image-folder' is not accepted here (tasks: tabular-csv)"),
    "task digest": (f'[tasks]\nimage-folder = ["{"0" * 64}"]', {}, "is not accepted here (tasks.image-folder lists 1"),
    "operator": ('operators = ["operator.alice"]', {}, "the run was started by 'operator'; this site accepts runs "
                 "from operator.alice"),
    "paused": ('accept_runs = false\npause_reason = "scanner upgrade until Monday"', {},
               "accepts no runs right now (accept_runs = false): scanner upgrade until Monday"),
    "broken file": ("[limits]\nlocal_epoch = 1", {}, "policy file is unusable, so it accepts no runs"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_run_outside_a_sites_policy_fails_before_any_transfer_and_show_names_the_site(world, case):
    text, params, words = REFUSALS[case]
    write_policy(world, text)  # the daemon is not restarted: the file is read again
    before = {r["run_id"] for r in world["ops"]["operator"].runs()}
    with pytest.raises(grpc.RpcError) as err:
        start(world, **params)
    site = world["names"][1]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"assignment refused by {site}: its site policy: " in err.value.details() and words in err.value.details()
    (run_id,) = {r["run_id"] for r in world["ops"]["operator"].runs()} - before
    run = world["ops"]["operator"].run(run_id)
    assert run["status"] == "failed" and run["refused_by"] == site and run["refused_by_policy"] is True
    assert words in run["refusal"] and run["started_by"] == "operator"
    assert run["hops"] == [] and run["final_transfers"] == [] and run["final"] is None
    # Every site's policy is asked before any site is assigned: no site kept anything of the run.
    assert not any((world["state"] / n / "runs" / run_id).exists() for n in world["names"])
    shown = cli(world, "show", run_id, "--json")
    assert shown.exit_code == 0, shown.output
    js = json.loads(shown.output)
    assert (js["refused_by"], js["refused_by_policy"], js["refusal"]) == (site, True, run["refusal"])
    text_view = flat(cli(world, "show", run_id).output)
    assert f"refused by {site} (its site policy), before any model moved: " in text_view and words in text_view
    # start-chain says it too, without a traceback.
    res = cli(world, "start-chain", "--seed", "1", "--peers", ",".join(world["names"]), "--order", "given",
              "--models-per-site", str(params.get("models_per_site", 1)), "--local-epochs",
              str(params.get("local_epochs", 1)), "--warmup-epochs", "1", "--strategy", params.get("strategy", "fedelmy"))
    assert res.exit_code != 0 and f"assignment refused by {site}" in flat(res.output) and "Traceback" not in res.output


def test_a_star_run_is_refused_before_any_site_is_assigned(world):
    """In a star plan every site trains as soon as it is assigned: the coordinator asks every
    site's policy (Peer.CheckPolicy) before it assigns any, so no site keeps anything."""
    write_policy(world, 'strategies = ["fedelmy"]\n')
    names = world["names"]
    before = {r["run_id"] for r in world["ops"]["operator"].runs()}
    with pytest.raises(grpc.RpcError) as err:
        world["ops"]["operator"].start_chain(peers=names, order="given", seed=1, model="cnn", aggregator=names[0],
                                             params=run_params.to_pb({**PARAMS, "strategy": "fedavg"}))
    assert f"assignment refused by {names[1]}: its site policy: strategy 'fedavg'" in err.value.details()
    (run_id,) = {r["run_id"] for r in world["ops"]["operator"].runs()} - before
    assert not any((world["state"] / n / "runs" / run_id).exists() for n in names)
    assert world["ops"]["operator"].run(run_id)["refused_by"] == names[1]


def test_an_allowed_run_by_a_second_operator_finishes_and_each_operator_is_recorded(world):
    site = world["names"][1]
    write_policy(world, 'accept_runs = true\nstrategies = ["fedelmy"]\noperators = ["operator", "operator.alice"]\n'
                        '[tasks]\nimage-folder = "*"\n[limits]\nlocal_epochs = 1\nwarmup_epochs = 1\n'
                        'models_per_site = 1\nrounds = 1\n')
    alice = world["ops"]["operator.alice"]
    reply = start(world, operator="operator.alice")
    for _ in alice.watch(reply.run_id):  # the stream ends with the run
        pass
    run = alice.run(reply.run_id)
    assert run["status"] == "finished", run["error"]
    assert run["started_by"] == "operator.alice" and run["refused_by"] is None and run["refused_by_policy"] is False
    assert (world["state"] / site / "runs" / reply.run_id).is_dir()
    assert "started by operator.alice" in flat(cli(world, "show", reply.run_id).output)
    # One operator starts a run, the other stops it: both are in the ledger and in `show`.
    other = start(world, operator="operator")
    stopped = alice.stop(other.run_id, reason="wrong seed")
    assert stopped["status"] == "cancelled"
    assert (stopped["started_by"], stopped["cancelled_by"]) == ("operator", "operator.alice")
    js = json.loads(cli(world, "show", other.run_id, "--json", operator="operator.alice").output)
    assert (js["started_by"], js["cancelled_by"]) == ("operator", "operator.alice")
    shown = flat(cli(world, "show", other.run_id).output)
    assert "started by operator" in shown and "cancelled by operator.alice" in shown
