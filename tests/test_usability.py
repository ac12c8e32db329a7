"""Usability: clear messages instead of tracebacks, the CLI's conveniences (-h, --version,
choices, environment variables, a run configuration file) and a loadable final model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from fedrelay.cli import connection, coordinator as coord_cli, peer as peer_cli
from conftest import flat

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
runner = CliRunner()


def run(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _commands():
    for group_name, app in (("coordinator", coord_cli.app), ("peer", peer_cli.app)):
        group = typer.main.get_command(app)
        yield group_name, group
        for name, cmd in group.commands.items():
            yield f"{group_name} {name}", cmd


def test_every_option_and_argument_has_help():
    missing = [f"{where}: {p.name}" for where, cmd in _commands() for p in cmd.params
               if not (getattr(p, "help", None) or "").strip()]
    assert not missing, "options without a help text: " + ", ".join(missing)


def invoke(app, *args, env: dict | None = None):
    res = runner.invoke(app, list(args), env=env)
    assert "Traceback" not in res.output and not isinstance(res.exception, (AssertionError, TypeError, KeyError)), \
        res.output
    return res


# -- CLI conveniences ---------------------------------------------------------------------------

def test_version_and_short_help_on_both_commands():
    from fedrelay import __version__

    for app in (coord_cli.app, peer_cli.app):
        res = invoke(app, "--version")
        assert res.exit_code == 0 and res.output.strip() == f"fedrelay {__version__}"
        assert invoke(app, "-h").exit_code == 0
    for where, cmd in _commands():
        if where in ("coordinator", "peer"):
            continue
        group, name = where.split()
        res = invoke(coord_cli.app if group == "coordinator" else peer_cli.app, name, "-h")
        assert res.exit_code == 0 and "Usage" in res.output, where


def test_choices_come_from_the_registry():
    from fedrelay import params, registry

    res = invoke(coord_cli.app, "start-chain", "--seed", "0", "--strategy", "fedavgg", "--insecure")
    assert res.exit_code == 2
    assert all(name in res.output for name in registry.STRATEGIES)
    help_text = flat(invoke(coord_cli.app, "start-chain", "-h").output)
    for values in (params.SELECTIONS, params.choices("ofasd_mode")):
        assert "|".join(values) in help_text.replace(" ", "").replace("│", "") or all(v in help_text for v in values)
    # --model is the task's: its models come with the sites' offers, and the coordinator refuses an
    # unknown one naming the task's models (tests/test_coordinator.py).
    for bad in (("--selection", "best"), ("--init", "none"), ("--order", "sorted"),
                ("--weighting", "x"), ("--maecho-alpha", "x"), ("--ofasd-mode", "x")):
        assert invoke(coord_cli.app, "start-chain", "--seed", "0", *bad, "--insecure").exit_code == 2, bad
    res = invoke(coord_cli.app, "start-chain", "--seed", "0", "--task", "no such task!", "--insecure")
    assert res.exit_code != 0 and "--task" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args, message", [
    (("--warmup-epochs", "-1"), "--warmup-epochs must be between 0"),
    (("-S", "-3"), "--models-per-site must be between 1"),
    (("-E", "100000000000"), "--local-epochs must be between 1"),
    (("--seed", "-1"), "--seed must be an integer between 0"),
    (("--rounds", "0"), "--rounds must be between 1"),
    (("--batch-size", "0"), "--batch-size must be between 1"),
    (("--lr", "-0.1"), "--lr must be > 0"),
    (("--maecho-tau", "-1"), "--maecho-tau must be between 0 and 4294967295"),  # not read by fedelmy; still on the wire
    (("--ofasd-epochs", "99999999999"), "--ofasd-epochs must be between 0 and 4294967295"),
])
def test_out_of_range_numbers_get_a_message_naming_the_option(args, message):
    argv = ["start-chain", "--seed", "0", "--insecure", *args]
    if "--seed" in args:
        argv[1:3] = []
    res = invoke(coord_cli.app, *argv)
    assert res.exit_code == 2 and message in flat(res.output), res.output


def test_every_field_is_checked_against_its_wire_type():
    from fedrelay import params

    base = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0,
                lr=1e-3, batch_size=8, weight_decay=0.0, selection="best-val")
    for name, value in (("maecho_tau", 2**32), ("ofasd_epochs", -1), ("maecho_eta", "x"), ("weighting", 3)):
        with pytest.raises(ValueError, match=params.OPTIONS[[f.name for f in params.OPTIONS].index(name)].flag):
            params.check({**base, name: value}, strict=True)
    params.to_pb({**base, "maecho_tau": 2**32 - 1})  # the largest uint32 fits


class _FakeClient:
    calls: list[dict] = []

    def start_chain(self, **kw):
        from fedrelay.v1 import coordinator_pb2 as cpb

        _FakeClient.calls.append(kw)
        return cpb.StartChainReply(run_id="r1", order=["a", "b"])


def test_config_file_sets_options_and_the_command_line_overrides_it(tmp_path, monkeypatch):
    monkeypatch.setattr(connection, "open_client", lambda *a: _FakeClient())
    _FakeClient.calls.clear()
    cfg = tmp_path / "run.toml"
    cfg.write_text('seed = 7\nstrategy = "fedseq"\nmodels-per-site = 3\nlocal_epochs = 4\nlr = 0.01\n'
                   'peers = ["a", "b"]\nselection = "last-epoch"\ninsecure = true\n')
    res = invoke(coord_cli.app, "start-chain", "--config", str(cfg), "-E", "2")
    assert res.exit_code == 0, res.output
    call = _FakeClient.calls[-1]
    assert (call["seed"], call["peers"]) == (7, ["a", "b"])
    p = call["params"]
    assert (p.strategy, p.models_per_site, p.local_epochs, p.lr, p.selection) == ("fedseq", 3, 2, 0.01, "last-epoch")
    # The repository's example file is valid.
    example = Path(__file__).resolve().parents[1] / "deploy" / "run.example.toml"
    assert invoke(coord_cli.app, "start-chain", "--config", str(example), "--insecure").exit_code == 0
    for text, message in (('sed = 1\n', "unknown key 'sed'"), ('seed = "1"\n', "key 'seed' must be an integer"),
                          ('seed = 1\nselection = "best"\n', "key 'selection' must be one of best-val, last-epoch"),
                          ('seed = 1\ntask = 3\n', "key 'task' must be"),
                          ('seed = 1\nwait = "yes"\n', "key 'wait' must be true or false"),
                          ('seed = \n', "not valid TOML")):
        cfg.write_text(text)
        res = invoke(coord_cli.app, "start-chain", "--config", str(cfg), "--insecure")
        assert res.exit_code == 2 and message in flat(res.output) and str(cfg) in flat(res.output), res.output


def test_environment_variables_for_tls_and_insecure(tmp_path):
    help_text = flat(invoke(coord_cli.app, "runs", "-h").output)
    assert "FEDRELAY_TLS" in help_text and "FEDRELAY_INSECURE" in help_text and "FEDRELAY_COORDINATOR" in help_text
    assert "FEDRELAY_TLS" in flat(invoke(peer_cli.app, "serve", "-h").output)
    # FEDRELAY_TLS is used as --tls (here an empty folder: the error names its missing key.pem).
    res = invoke(coord_cli.app, "runs", "-c", "127.0.0.1:9", env={"FEDRELAY_TLS": str(tmp_path)})
    assert res.exit_code == 2 and "key.pem" in res.output
    # --tls typed on the command line wins over FEDRELAY_INSECURE in the environment, and back.
    res = invoke(coord_cli.app, "runs", "-c", "127.0.0.1:9", "--tls", str(tmp_path), env={"FEDRELAY_INSECURE": "1"})
    assert res.exit_code == 2 and "key.pem" in res.output and "not both" not in res.output
    res = invoke(coord_cli.app, "runs", "-c", "127.0.0.1:9", "--insecure", env={"FEDRELAY_TLS": str(tmp_path)})
    assert "not both" not in res.output and "key.pem" not in res.output


def test_enroll_refuses_to_overwrite_an_identity(tmp_path):
    pki = tmp_path / "pki"
    assert invoke(coord_cli.app, "init-ca", "--out", str(pki)).exit_code == 0
    out = tmp_path / "site-a.pki"
    assert invoke(coord_cli.app, "enroll", "site-a", "--ca", str(pki), "--out", str(out)).exit_code == 0
    key = (out / "key.pem").read_bytes()
    res = invoke(coord_cli.app, "enroll", "site-a", "--ca", str(pki), "--out", str(out))
    assert res.exit_code == 2 and "--force" in flat(res.output) and (out / "key.pem").read_bytes() == key
    assert invoke(coord_cli.app, "enroll", "site-a", "--ca", str(pki), "--out", str(out), "--force").exit_code == 0
    assert (out / "key.pem").read_bytes() != key


# -- messages, not tracebacks -------------------------------------------------------------------

def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write: a read-only folder, or for root (who writes through
    permission bits) a path under /proc."""
    import os

    if os.geteuid() == 0:
        return Path("/proc/fedrelay-test")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_coordinator_ledger_that_cannot_be_opened_is_a_clear_error(tmp_path):
    from fedrelay.coordinator.ledger import Ledger, LedgerError

    junk = tmp_path / "notes.txt"
    junk.write_text("these are not the ledger's tables\n" * 100)
    cases = ((tmp_path, "is a folder"), (junk, "not an SQLite database"),
             (_unwritable_folder(tmp_path) / "ledger.sqlite", "in a folder this user can write"))
    for db, message in cases:
        with pytest.raises(LedgerError, match=message):
            Ledger(db)
    assert junk.read_text().startswith("these are not")  # nothing lost
    res = run("coordinator", "serve", "--insecure", "--listen", "127.0.0.1:0", "--db", str(junk), timeout=60)
    assert res.returncode == 2 and "not an SQLite database" in flat(res.stderr) and "Traceback" not in res.stderr


def test_read_only_state_dir_is_refused_at_start(tmp_path):
    from fedrelay.transport import Transport
    from fedrelay.peer import daemon

    state = _unwritable_folder(tmp_path) / "state"
    with pytest.raises(ValueError, match="--state-dir .* is not a writable folder"):
        daemon.serve(data_dir=tmp_path / "nowhere", name="site-a", listen="127.0.0.1:0", coordinator="127.0.0.1:9",
                     state_dir=state, device="cpu", transport=Transport.insecure())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--state-dir"):
        daemon.check_state_dir(tmp_path / "file")
    daemon.check_state_dir(tmp_path / "new" / "state")
    assert (tmp_path / "new" / "state").is_dir() and not any((tmp_path / "new" / "state").iterdir())


def test_tls_and_plaintext_mismatch_is_named(tmp_path):
    import threading

    from fedrelay.coordinator import pki
    from fedrelay.coordinator.service import serve
    from fedrelay.transport import Transport, speaks_tls

    pki.init_ca(tmp_path / "pki")
    stop, servers = threading.Event(), {}
    threads = []
    for kind, transport in (("tls", Transport.from_dir(tmp_path / "pki" / "coordinator")),
                            ("plain", Transport.insecure())):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ready = threading.Event()
        t = threading.Thread(target=serve, args=(f"127.0.0.1:{port}", tmp_path / f"{kind}.sqlite"),
                             kwargs=dict(transport=transport, ready=ready, stop=stop), daemon=True)
        t.start()
        assert ready.wait(30)
        servers[kind], threads = f"127.0.0.1:{port}", threads + [t]
    try:
        assert speaks_tls(servers["tls"]) is True and speaks_tls(servers["plain"]) is False
        res = invoke(coord_cli.app, "runs", "-c", servers["tls"], "--insecure")
        assert res.exit_code == 2 and f"the coordinator at {servers['tls']} speaks TLS" in flat(res.output)
        assert "--tls DIR" in flat(res.output)
        res = invoke(coord_cli.app, "runs", "-c", servers["plain"], "--tls", str(tmp_path / "pki" / "operator"))
        assert res.exit_code == 2 and f"the coordinator at {servers['plain']} speaks plaintext" in flat(res.output)
        assert "pass --insecure" in flat(res.output)
        res = invoke(peer_cli.app, "status", "--peer", servers["tls"], "--insecure")  # any TLS server will do
        assert res.exit_code == 2 and "speaks TLS" in flat(res.output)
        # Nothing listening: still "not reachable".
        res = invoke(coord_cli.app, "runs", "-c", "127.0.0.1:9", "--insecure")
        assert res.exit_code == 3 and "not reachable" in flat(res.output)
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_fetch_model_into_a_folder_writes_run_id_safetensors(tmp_path, monkeypatch):
    written = []

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def fetch_model(self, run_id, out):
            written.append(out)
            return "ab" * 32, 10

    monkeypatch.setattr(connection, "open_client", lambda *a: Client())
    res = invoke(coord_cli.app, "fetch-model", "run-1", "-o", str(tmp_path), "--insecure")
    assert res.exit_code == 0 and written == [tmp_path / "run-1.safetensors"]


def test_skipped_files_and_every_corrupt_image_are_reported(tmp_path):
    from PIL import Image

    from fedrelay.tasks.image_folder.data import DataError, load_site

    root = tmp_path / "site"
    (root / "train" / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("L", (8, 8), i).save(root / "train" / "a" / f"ok{i}.png")
    for name in ("x.bmp", "y.webp", "z.tif", "w.gif"):
        Image.new("L", (8, 8), 1).save(root / "train" / "a" / name)
    (root / "train" / "a" / ".hidden").write_text("")
    site = load_site(root)
    assert site.train_counts == {"a": 3}
    assert sorted(p.name for p in site.skipped) == ["w.gif", "x.bmp", "y.webp", "z.tif"]
    msg = site.skipped_message()
    assert msg.startswith("skipped 4 file(s)") and "w.gif" in msg and msg.count("train/a/") == 3
    for i in range(5):
        (root / "train" / "a" / f"bad{i}.png").write_bytes(b"not a png")
    with pytest.raises(DataError) as err:
        load_site(root)
    text = str(err.value)
    assert text.startswith("5 images of") and all(f"bad{i}.png" in text for i in range(3))


# -- the final model ----------------------------------------------------------------------------

def test_load_model_from_a_file_with_metadata(tmp_path):
    import hashlib

    import torch

    from fedrelay import final_model, load_model
    from fedrelay.tensors import encode_state
    from fedrelay.models import build_model
    from fedrelay.tasks.image_folder import spec as image_spec

    torch.manual_seed(0)
    source = build_model(image_spec("cnn", 1, (12, 12), 3)).eval()
    site_bytes = encode_state(source.state_dict())  # what the sites exchange; its digest is the ledger's
    sha = hashlib.sha256(site_bytes).hexdigest()
    meta = final_model.describe(spec=image_spec("cnn", 1, (12, 12), 3).to_dict(), class_names=["cat", "dog", "eel"],
                                run_id="r-1", strategy="fedelmy", final_sha256=sha)
    path = tmp_path / "final.safetensors"
    path.write_bytes(final_model.with_metadata(site_bytes, meta))
    assert path.read_bytes().endswith(site_bytes[-1000:])  # the tensors' bytes are untouched
    assert final_model.original_sha256(path) == sha
    model, classes = load_model(path)
    assert classes == ["cat", "dog", "eel"] and not model.training
    x = torch.rand(4, 1, 12, 12)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    # A site's file has no metadata; a file whose tensors are not the run's fails the digest check.
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(site_bytes)
    with pytest.raises(ValueError, match="no fedrelay metadata.*fetch-model"):
        load_model(bare)
    other = tmp_path / "other.safetensors"
    other.write_bytes(final_model.with_metadata(encode_state(build_model(image_spec("cnn", 1, (12, 12), 3))
                                                             .state_dict()), meta))
    with pytest.raises(ValueError, match="not the run's final model"):
        load_model(other)


def test_the_example_config_shows_every_declared_option_at_its_default():
    """deploy/run.example.toml lists every option the registry declares (commented, at its
    default), so that a reader of the example sees the methods' options too."""
    import tomllib

    from fedrelay import registry

    example = (Path(__file__).resolve().parents[1] / "deploy" / "run.example.toml").read_text()
    shown = {}
    for line in example.splitlines():
        if line.startswith("# ") and " = " in line and not line.startswith("# #"):
            try:
                shown.update(tomllib.loads(line[2:].split("  #")[0]))
            except tomllib.TOMLDecodeError:
                continue
    missing = [o.name for o in registry.all_options() if o.name.replace("_", "-") not in shown]
    assert not missing, f"deploy/run.example.toml lacks {missing}"
    for o in registry.all_options():
        assert shown[o.name.replace("_", "-")] == o.default, o.name
