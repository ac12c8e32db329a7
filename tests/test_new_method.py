"""A new method is one module and one registry entry (issue #24, "Methods declare their options").

``tests/toy_method.py`` holds a toy parallel method (aggregator ``toy-mean``, strategy ``toy``)
with two options, ``toy_repeats`` (int, 1..3) and ``toy_weight`` (float, (0, 1]), declared in its
registry entries and nowhere else. Without any other change, ``start-chain --help`` lists them,
its ``--config`` file takes them, the CLI and the coordinator refuse a value out of range naming
the flag, and a run through real daemons hands them to the method, typed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import grpc
import pytest
import toy_method

from fedrelay import params, registry
from fedrelay.cli import exits
from conftest import flat, invoke_coordinator as invoke

HERE = Path(__file__).resolve().parent
BASE = dict(strategy="toy", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0, lr=1e-3,
            batch_size=32, weight_decay=0.0, selection="last-epoch")


@pytest.fixture(scope="module", autouse=True)
def toy():
    """The toy registered in this process (the daemons register it from FEDRELAY_METHODS)."""
    registry.register(*toy_method.METHODS)
    yield
    registry.unregister(*toy_method.METHODS)


def test_start_chain_help_lists_the_options_with_their_help_and_defaults():
    text = flat(invoke("start-chain", "--help").output)
    assert "toy: a toy parallel method" in text  # --strategy's choices and help: the registry's
    assert re.search(r"--toy-repeats <int> toy: how many times the toy says so \(1 to 3\)\.[^-]*\[default: 1\]", text)
    assert re.search(r"--toy-weight <float> toy: a weight in \(0, 1\]\.[^-]*\[default: 0\.5\]", text)
    assert "--maecho-tau" in text and "--weighting" in text  # the methods before it keep theirs


def test_the_options_are_checked_as_declared_by_the_cli_with_a_message_naming_the_flag():
    for flags, words in ((("--toy-weight", "2"), "--toy-weight must be between 0 and 1, got 2.0"),
                         (("--toy-repeats", "0"), "--toy-repeats must be between 1 and 3, got 0"),
                         (("--toy-weight", "0"), "--toy-weight must be > 0, got 0.0")):
        res = invoke("start-chain", "--seed", "1", "--strategy", "toy", *flags, "--coordinator", "127.0.0.1:9",
                     "--insecure")
        assert res.exit_code == exits.USAGE and words in flat(res.output), res.output
        assert "not reachable" not in res.output  # refused before the coordinator is called
    res = invoke("start-chain", "--seed", "1", "--toy-repeats", "many", "--insecure")
    assert res.exit_code == exits.USAGE and "--toy-repeats" in res.output


def test_the_config_file_takes_the_options_by_their_names(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('seed = 1\nstrategy = "toy"\ntoy-repeats = 3\ntoy_weight = 1.5\n')
    res = invoke("start-chain", "--config", str(cfg), "--coordinator", "127.0.0.1:9", "--insecure")
    assert res.exit_code == exits.USAGE and "--toy-weight must be between 0 and 1, got 1.5" in flat(res.output)
    cfg.write_text('seed = 1\nstrategy = "toy"\ntoy-repeats = "3"\n')
    res = invoke("start-chain", "--config", str(cfg), "--insecure")
    assert res.exit_code == exits.USAGE and "key 'toy-repeats' must be an integer" in flat(res.output)


def test_the_wire_carries_the_options_as_text_and_gives_them_back_typed():
    d = {**BASE, "toy_repeats": 3, "toy_weight": 0.1 + 0.2}
    pb = params.to_pb(d)
    assert dict(pb.method_options) == {"toy_repeats": "3", "toy_weight": repr(0.1 + 0.2)}
    back = params.to_dict(pb)
    assert back["toy_repeats"] == 3 and back["toy_weight"] == 0.1 + 0.2 and type(back["toy_repeats"]) is int
    params.check(back)
    opts = params.options(back)
    assert (opts["toy_repeats"], opts["toy_weight"]) == (3, 0.1 + 0.2)
    assert params.options(params.to_dict(params.to_pb(BASE)))["toy_weight"] == 0.5  # unset: the declared default
    # An existing method's options keep their own fields: a run's recorded params do not change.
    assert not params.to_pb({**BASE, "strategy": "maecho", "maecho_tau": 7}).method_options
    # Text that is not the declared type, and an option nobody declares, are refused by name.
    pb.method_options["toy_repeats"] = "many"
    with pytest.raises(ValueError, match="--toy-repeats must be an integer, got 'many'"):
        params.check(params.to_dict(pb))
    pb.method_options.clear()
    pb.method_options["toy_colour"] = "red"
    with pytest.raises(ValueError, match="unknown method option 'toy_colour'.*--toy-repeats, --toy-weight"):
        params.check(params.to_dict(pb))


@pytest.mark.integration
def test_a_run_through_the_daemons_hands_the_method_its_options(three_sites, tmp_path):
    from deploy import local_trial
    from fedrelay.coordinator.client import OperatorClient

    record = tmp_path / "record"
    record.mkdir()
    env = {registry.PLUGINS_ENV: "toy_method:METHODS", toy_method.RECORD_ENV: str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    with local_trial.LocalTrial(tmp_path / "trial", three_sites[:2], insecure=True, env=env) as trial:
        # The coordinator refuses a value out of range, naming the flag (a client that skipped the check).
        with OperatorClient(trial.coordinator, trial.transport()) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.start_chain(peers=[], order="random", seed=1, params=params.to_pb({**BASE, "toy_repeats": 4}))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--toy-repeats must be between 1 and 3, got 4" in err.value.details()
        cfg = tmp_path / "run.toml"
        cfg.write_text('seed = 5\nstrategy = "toy"\nmodels-per-site = 1\nlocal-epochs = 1\nwarmup-epochs = 0\n'
                       'batch-size = 32\nselection = "last-epoch"\ntoy-repeats = 3\ntoy-weight = 0.25\n')
        res = trial.cli("start-chain", "--config", str(cfg), "--wait", "--json", capture_output=True, text=True,
                        timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        run = json.loads(res.stdout)
    assert run["status"] == "finished", run["error"]
    assert (run["params"]["toy_repeats"], run["params"]["toy_weight"]) == (3, 0.25)  # the ledger's record
    seen = [json.loads(p.read_text()) for p in sorted(record.iterdir())]
    assert sorted(r["stage"] for r in seen) == ["aggregate", "site", "site"]  # each site's upload, the aggregation
    assert all(r["options"] == {"toy_repeats": ["int", 3], "toy_weight": ["float", 0.25]} for r in seen), seen


def test_a_chain_strategy_gets_its_declared_options_typed_at_its_train(one_torch_thread):
    """A chain strategy's own option, carried as text on the wire (``method_options``), reaches
    its ``train`` as an int through the peer's path (params.options -> run_site); unset, its
    default."""
    import torch

    from fedrelay.peer.training import TrainConfig, run_site
    from fedrelay.tasks.image_folder import spec as image_spec

    spec = image_spec("cnn", 1, (8, 8), 3)
    g = torch.Generator().manual_seed(0)
    data = (torch.randint(0, 255, (12, 1, 8, 8), generator=g, dtype=torch.uint8), torch.arange(12) % 3)
    run = {**BASE, "strategy": "toy-seq", "warmup_epochs": 1, "batch_size": 4}
    cfg = TrainConfig(**params.train_config(run))
    for given, expected in (({"toy_visits": 7}, 7), ({}, 1)):
        pb = params.to_pb({**run, **given})
        assert dict(pb.method_options) == {k: str(v) for k, v in given.items()}
        d = params.to_dict(pb)
        params.check(d)
        toy_method.SEEN.clear()
        run_site(None, spec, data, data, cfg, 0, "cpu", options=params.options(d))
        (seen,) = toy_method.SEEN
        assert seen["toy_visits"] == expected and type(seen["toy_visits"]) is int


@pytest.mark.integration
def test_a_plug_in_that_cannot_be_loaded_ends_the_command_with_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, registry.PLUGINS_ENV: "no_such_module_here:METHODS"}
    res = subprocess.run([sys.executable, "-c", "from fedrelay.cli.coordinator import app; app()", "runs"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    assert "FEDRELAY_METHODS=no_such_module_here:METHODS: cannot register" in res.stderr
    assert "No module named 'no_such_module_here'" in res.stderr
