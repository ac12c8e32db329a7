"""One CLI convention (docs/cli-conventions.md): exit codes, --json, FEDRELAY_* variables, config
files, HOST:PORT options, messages naming the flag, no silent defaults (docs/cli-conventions.md).

Every command is found from the typer apps (never listed here): each is walked with a bad value
on the command line and in its environment variable, in-process; the few cases that need a
process of their own (gRPC's C core writes straight to the process's stderr; `peer serve --check`
reads the data folder in a worker) run one and are marked integration."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import typing
from pathlib import Path

import grpc
import pytest
import typer.main
from typer.testing import CliRunner

from fedrelay.cli import connection, coordinator as coord_cli, exits, fedrelay as fedrelay_cli, peer as peer_cli
from fedrelay.cli.common import address_callback, web_callback

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
GROUPS = (("coordinator", coord_cli.app, "FEDRELAY_COORDINATOR"), ("peer", peer_cli.app, "FEDRELAY_PEER"),
          ("fedrelay", fedrelay_cli.app, "FEDRELAY"))
# gRPC's C core log line: "E1127 13:26:15.538056   22732 add_port.cc:83] ..."
C_CORE_LINE = re.compile(r"^[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.M)


def commands():
    """(group, app, env prefix, command name, click command) for every command of every app."""
    for group, app, prefix in GROUPS:
        for name, cmd in typer.main.get_command(app).commands.items():
            yield group, app, prefix, name, cmd


ALL = [pytest.param(g, a, p, n, c, id=f"{g} {n}") for g, a, p, n, c in commands()]


def annotation(param):
    desc = getattr(param, "type_descriptor", None)
    return desc.annotation if desc is not None else str


def is_address(param) -> bool:
    """Whether the option takes HOST:PORT (its callback is the shared address check)."""
    desc = getattr(param, "type_descriptor", None)
    return desc is not None and getattr(desc.parameter_info, "callback", None) in (address_callback, web_callback)


def filler(param) -> str:
    """A value the parser accepts for ``param``."""
    ann = annotation(param)
    if typing.get_origin(ann) is typing.Literal:
        return str(typing.get_args(ann)[0])
    if ann in (int, float):
        return "1"
    if is_address(param):
        return "127.0.0.1:9"
    return "x"


def required_args(cmd, but=None) -> list[str]:
    """Values for the command's required options and arguments (other than ``but``)."""
    out: list[str] = []
    for p in cmd.params:
        if p is but or not p.required:
            continue
        if p.param_type_name == "argument":
            out.append(filler(p))
        else:
            out += [p.opts[0], filler(p)]
    return out


def bad_value(param) -> str | None:
    """A value the parser refuses for ``param`` (None: none it would refuse by itself)."""
    ann = annotation(param)
    if typing.get_origin(ann) is typing.Literal:
        return "no-such-choice"
    if ann in (int, float) and not getattr(param, "is_flag", False):
        return "notanumber"
    if is_address(param):
        return "notanaddress"
    return None


def checked_options(cmd):
    return [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "is_flag", False)
            and bad_value(p) is not None]


def assert_usage_error(res, flag: str):
    assert res.exit_code == exits.USAGE, (flag, res.exit_code, res.output)
    assert "Traceback" not in res.output and not C_CORE_LINE.search(res.output), res.output
    assert flag in res.output, (flag, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


@pytest.mark.parametrize("group, app, prefix, name, cmd", ALL)
def test_every_command_refuses_a_bad_value_with_exit_2_naming_the_flag(group, app, prefix, name, cmd):
    res = runner.invoke(app, [name, *required_args(cmd), "--no-such-option"])
    assert_usage_error(res, "--no-such-option")
    for p in checked_options(cmd):
        flag = max(p.opts, key=len)
        res = runner.invoke(app, [name, *required_args(cmd, but=p), flag, bad_value(p)])
        assert_usage_error(res, flag)


@pytest.mark.parametrize("group, app, prefix, name, cmd", ALL)
def test_every_option_reads_a_fedrelay_variable(group, app, prefix, name, cmd, monkeypatch):
    """Each option takes its value from FEDRELAY_... (its own variable, e.g. FEDRELAY_COORDINATOR,
    else GROUP_COMMAND_OPTION); a bad value there is refused like one on the command line."""
    for p in cmd.params:  # an option's own variables: one of fedrelay's at least (a library's may follow)
        if p.param_type_name == "option" and p.envvar:
            variables = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
            assert variables[0].startswith("FEDRELAY_"), (p.name, variables)
    for p in checked_options(cmd):
        var = p.envvar or f"{prefix}_{name}_{p.name}".upper().replace("-", "_")
        res = runner.invoke(app, [name, *required_args(cmd, but=p)], env={var: bad_value(p)})
        assert_usage_error(res, max(p.opts, key=len))


def json_commands():
    """Commands that print data: every command but the daemons (they log)."""
    return [c for c in ALL if c.values[3] not in ("serve", "relay")]


@pytest.mark.parametrize("group, app, prefix, name, cmd", json_commands())
def test_every_command_that_prints_data_has_json_and_its_errors_are_json(group, app, prefix, name, cmd):
    assert any("--json" in p.opts for p in cmd.params), f"{group} {name} has no --json"
    res = runner.invoke(app, [name, *required_args(cmd), "--json", "--no-such-option"])
    error = json.loads(res.stdout)
    assert res.exit_code == exits.USAGE and error["code"] == exits.USAGE and "--no-such-option" in error["error"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the cases docs/cli-conventions.md names -------------------------------------------------

def test_exit_codes_tell_a_bad_value_an_unreachable_daemon_a_failed_run_and_a_refusal_apart(monkeypatch):
    down = f"127.0.0.1:{closed_port()}"
    assert runner.invoke(coord_cli.app, ["runs", "-c", "nohost", "--insecure"]).exit_code == exits.USAGE
    res = runner.invoke(coord_cli.app, ["runs", "-c", down, "--insecure", "--json"])
    assert res.exit_code == exits.UNREACHABLE and json.loads(res.stdout)["code"] == exits.UNREACHABLE
    assert "not reachable" in json.loads(res.stdout)["error"]
    for argv in (["peer", "status"], ["peer", "health"]):
        res = runner.invoke(peer_cli.app, [argv[1], "--peer", down, "--insecure", "--json", "--timeout", "2"]
                            if argv[1] == "health" else [argv[1], "--peer", down, "--insecure", "--json"])
        assert res.exit_code == exits.UNREACHABLE, res.output
        assert json.loads(res.stdout)["code"] == exits.UNREACHABLE

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.PERMISSION_DENIED

        def details(self):
            return "the operator identity is required"

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def runs(self):
            raise Refused()

        def run(self, run_id):
            return {"status": "failed", "run_id": run_id}

    monkeypatch.setattr(connection, "open_client", lambda *a: Client())
    res = runner.invoke(coord_cli.app, ["runs", "--json"])
    assert res.exit_code == exits.REFUSED and json.loads(res.stdout) == {
        "error": "the operator identity is required", "code": exits.REFUSED}
    res = runner.invoke(coord_cli.app, ["watch", "r1", "--json"])
    assert res.exit_code == exits.FAILED and json.loads(res.stdout)["status"] == "failed"


def test_split_dataset_sites_0_names_the_flag(tmp_path):
    res = runner.invoke(coord_cli.app, ["split-dataset", "breast-cancer", "--sites", "0", "--out", str(tmp_path)])
    assert res.exit_code == exits.USAGE and "--sites" in res.output and "n_sites" not in res.output
    res = runner.invoke(coord_cli.app, ["split-dataset", "breast-cancer", "--dirichlet", "0", "--out", str(tmp_path)])
    assert res.exit_code == exits.USAGE and "--dirichlet" in res.output and "alpha" not in res.output


@pytest.mark.parametrize("value, words", [("notanaddress", "has no port"), ("host:", "has no port"),
                                          ("host:port", "is not a number"), ("host:70000", "1-65535"),
                                          (":50070", "has no host"), ("bad host:1", "the host must be")])
def test_a_malformed_address_says_what_is_missing(value, words):
    for app, argv in ((coord_cli.app, ["runs", "-c", value]), (peer_cli.app, ["status", "--peer", value]),
                      (peer_cli.app, ["serve", "--data", "x", "--name", "a", "-c", value])):
        res = runner.invoke(app, argv)
        assert res.exit_code == exits.USAGE and words in " ".join(res.output.split()), res.output


def test_web_takes_host_port_like_metrics_listen_and_a_bare_port_still_works():
    p = parsed(coord_cli.app, "serve", ["--web", "0.0.0.0:8070", "--metrics-listen", "127.0.0.1:9100"])
    assert (p["web"], p["metrics_listen"]) == ("0.0.0.0:8070", "127.0.0.1:9100")
    res = runner.invoke(coord_cli.app, ["serve", "--web", "8070", "--listen", "nope"])
    assert "--web 8070: a bare PORT is deprecated; write --web 127.0.0.1:8070" in " ".join(res.output.split())
    assert parsed(coord_cli.app, "serve", ["--web", "8070"])["web"] == "127.0.0.1:8070"


def parsed(app, name: str, args: list[str]) -> dict:
    """The parameters ``app name args`` would run with (parsed as the console script does, under
    its group's context: FEDRELAY_GROUP_COMMAND_OPTION variables included), without running it."""
    group = typer.main.get_command(app)
    parent = group.make_context(group.name or "app", [name])
    return group.commands[name].make_context(name, list(args), parent=parent).params


def test_both_daemons_read_a_config_file_and_fedrelay_variables(tmp_path, monkeypatch):
    cfg = tmp_path / "peer.toml"
    cfg.write_text('name = "site-a"\ndata = "/srv/site-a"\nlisten = "0.0.0.0:50071"\nadvertise = "a.example:50071"\n'
                   'coordinator = "coord.example:50070"\ntask = ["tabular-csv"]\nworker-slots = 2\n')
    p = parsed(peer_cli.app, "serve", ["--config", str(cfg), "--worker-slots", "4"])
    assert (p["name"], str(p["data"]), p["listen"], p["advertise"], p["coordinator"], p["task"], p["worker_slots"]) \
        == ("site-a", "/srv/site-a", "0.0.0.0:50071", "a.example:50071", "coord.example:50070", ["tabular-csv"], 4)
    # The site kit's peer.env variables are peer serve's own (not only through systemd's unit).
    for k, v in {"FEDRELAY_NAME": "site-b", "FEDRELAY_DATA": "/srv/b", "FEDRELAY_LISTEN": "0.0.0.0:1",
                 "FEDRELAY_ADVERTISE": "b.example:1", "FEDRELAY_STATE_DIR": "/var/lib/b"}.items():
        monkeypatch.setenv(k, v)
    p = parsed(peer_cli.app, "serve", [])
    assert (p["name"], p["listen"], p["advertise"], str(p["state_dir"])) == ("site-b", "0.0.0.0:1", "b.example:1",
                                                                             "/var/lib/b")
    (tmp_path / "coord.toml").write_text('listen = "0.0.0.0:50070"\ndb = "/var/lib/l.sqlite"\npeer-timeout = 30.0\n')
    monkeypatch.setenv("FEDRELAY_COORDINATOR_SERVE_PEER_TIMEOUT", "45")
    p = parsed(coord_cli.app, "serve", ["--config", str(tmp_path / "coord.toml")])
    assert (p["listen"], str(p["db"]), p["peer_timeout"]) == ("0.0.0.0:50070", "/var/lib/l.sqlite", 45.0)
    (tmp_path / "bad.toml").write_text('peer_timout = 3\n')
    res = runner.invoke(coord_cli.app, ["serve", "--config", str(tmp_path / "bad.toml")])
    assert res.exit_code == exits.USAGE and "unknown key 'peer_timout'" in " ".join(res.output.split())
    res = runner.invoke(coord_cli.app, ["start-chain", "--json", "--config", str(tmp_path / "bad.toml")])
    assert res.exit_code == exits.USAGE and "unknown key 'peer_timout'" in json.loads(res.stdout)["error"]


@pytest.mark.integration
def test_coordinator_serve_with_a_bad_listen_address_leaves_nothing_behind(tmp_path):
    """No gRPC C-core line, no ledger file: a malformed address is refused while the command line
    is parsed, a taken port before the ledger is opened."""
    db = tmp_path / "ledger.sqlite"
    res = subprocess.run([str(BIN / "coordinator"), "serve", "--listen", "bad", "--insecure", "--db", str(db)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == exits.USAGE and "--listen" in res.stderr and "has no port" in res.stderr
    assert not C_CORE_LINE.search(res.stderr) and "Traceback" not in res.stderr, res.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = subprocess.run([str(BIN / "coordinator"), "serve", "--listen", f"127.0.0.1:{taken.getsockname()[1]}",
                              "--insecure", "--db", str(db)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == exits.FAILED and "cannot listen on" in res.stderr and "in use" in res.stderr
    assert not C_CORE_LINE.search(res.stderr) and "Traceback" not in res.stderr, res.stderr
    assert not db.exists() and list(tmp_path.iterdir()) == []
    res = runner.invoke(coord_cli.app, ["serve", "--peer-timeout", "-1", "--insecure", "--db", str(db)])
    assert res.exit_code == exits.USAGE and "--peer-timeout must be > 0" in res.output and not db.exists()


@pytest.mark.integration
def test_an_unreachable_daemon_gets_one_clear_line_and_no_c_core_line():
    """As the console scripts run (gRPC's C core writes to the process's stderr): each group's
    networked commands against a closed port exit 3 with one error line."""
    down = f"127.0.0.1:{closed_port()}"
    for argv in (("coordinator", "runs", "-c", down), ("coordinator", "health", "-c", down, "--timeout", "2"),
                 ("peer", "status", "--peer", down), ("peer", "health", "--peer", down, "--timeout", "2")):
        res = subprocess.run([str(BIN / argv[0]), *argv[1:], "--insecure"], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == exits.UNREACHABLE, (argv, res.stdout, res.stderr)
        assert not C_CORE_LINE.search(res.stderr + res.stdout) and "Traceback" not in res.stderr, res.stderr


@pytest.mark.integration
def test_peer_serve_at_a_loopback_address_warns_or_refuses(tmp_path):
    from fedrelay.peer.reachability import judge

    # The coordinator is elsewhere: nobody else could dial 127.0.0.1 -> refused, before anything else.
    res = runner.invoke(peer_cli.app, ["serve", "--data", str(tmp_path), "--name", "a", "--insecure",
                                       "-c", "10.0.0.1:50070"])
    out = " ".join(res.output.split())
    assert res.exit_code == exits.USAGE and "--listen 127.0.0.1:0 is a loopback address" in out
    assert "--advertise HOST:PORT" in out
    # Everything on this host: a warning (and the daemon goes on to its next check).
    res = runner.invoke(peer_cli.app, ["serve", "--data", str(tmp_path / "nowhere"), "--name", "a", "--insecure",
                                       "--check"])
    out = " ".join(res.output.split())
    assert "warning: --listen 127.0.0.1:0 is a loopback address: only sites on this host" in out
    assert "the port is chosen anew at every start" in out
    # A loopback --listen given on purpose, with the coordinator on this host: no warning.
    res = runner.invoke(peer_cli.app, ["serve", "--data", str(tmp_path / "nowhere"), "--name", "a", "--insecure",
                                       "--listen", "127.0.0.1:0", "--check"])
    assert "is a loopback address" not in res.output and "chosen anew" not in res.output and res.exit_code == exits.USAGE
    res = runner.invoke(peer_cli.app, ["serve", "--data", str(tmp_path), "--name", "a", "--insecure",
                                       "--listen", "127.0.0.1:50071", "-c", "coord.example.org:50070"])
    assert res.exit_code == exits.USAGE and "loopback address" in res.output
    assert judge(listen="0.0.0.0:50071", advertise="a.example.org:50071", coordinator="10.0.0.1:50070",
                 outbound_only=False) == judge(listen="127.0.0.1:0", advertise=None, coordinator="c:1",
                                               outbound_only=True)
    assert judge(listen="[::1]:5", advertise=None, coordinator="[::1]:6", outbound_only=False).warnings
    assert judge(listen="0.0.0.0:5", advertise="localhost:5", coordinator="c.example:6", outbound_only=False).problem


def test_check_does_not_report_a_loopback_port_0_as_fine(tmp_path, monkeypatch):
    from fedrelay.peer import preflight

    class Found:
        address, device, offers = "127.0.0.1:0", "cpu", []

        @staticmethod
        def lines():
            return ["task image-folder: 10 samples in 2 classes"]

    monkeypatch.setattr(preflight, "check_serve_options", lambda **kw: Found())
    res = runner.invoke(peer_cli.app, ["serve", "--data", str(tmp_path), "--name", "a", "--insecure", "--check"])
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "ok: site a" in out and "dialled at 127.0.0.1:0" not in out
    assert "dialled at 127.0.0.1:<a free port chosen at start> (from this host only)" in out
    assert "warning: --listen 127.0.0.1:0 is a loopback address" in out


def test_unknown_scenario_or_strategy_is_refused_with_the_choices(capsys):
    from deploy import local_trial, netns_trial

    with pytest.raises(SystemExit) as stop:
        netns_trial.main(["--faults", "kill-peer,firewalled"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "'firewalled'" in err and all(s in err for s in netns_trial.SCENARIOS)
    problem = local_trial.chain_args_problem(["--strategy", "fedprox"])
    assert "--strategy" in problem and "fedelmy" in problem and "fedseq" in problem
    assert local_trial.chain_args_problem(["--strategy", "fedseq", "-S", "3"]) is None
    res = runner.invoke(coord_cli.app, ["start-chain", "--seed", "1", "--strategy", "fedprox", "--json"])
    assert res.exit_code == exits.USAGE and "fedelmy" in json.loads(res.stdout)["error"]


def test_log_lines_carry_the_date_and_the_utc_offset(capsys):
    import logging

    from fedrelay.cli.common import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []
    try:
        setup_logging(False, prefix="[site-a] ")
        logging.getLogger("fedrelay.test").info("hello")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d:\d\d \[site-a\] INFO hello", line), line


def test_the_exit_codes_are_documented():
    doc = (ROOT / "docs" / "cli-conventions.md").read_text()
    for code in exits.MEANING:
        assert re.search(rf"^\| *{code} *\|", doc, re.M), f"exit code {code} is not in docs/cli-conventions.md"


def test_another_federations_identity_is_refused_with_exit_4(tmp_path):
    """A TLS handshake that fails (the caller's certificate is of another CA) is a refusal (4),
    for the coordinator's commands, the health probes and peer status alike."""
    import threading

    from fedrelay.transport import Transport
    from fedrelay.coordinator import pki
    from fedrelay.coordinator.service import serve

    pki.init_ca(tmp_path / "ours")
    pki.init_ca(tmp_path / "theirs")
    address = f"127.0.0.1:{closed_port()}"
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve, args=(address, tmp_path / "ledger.sqlite"), daemon=True,
                              kwargs=dict(transport=Transport.from_dir(tmp_path / "ours" / "coordinator"),
                                          ready=ready, stop=stop))
    thread.start()
    try:
        assert ready.wait(60)
        theirs = str(tmp_path / "theirs" / "operator")
        for app, argv in ((coord_cli.app, ["runs", "-c", address]), (coord_cli.app, ["health", "-c", address]),
                          (peer_cli.app, ["status", "--peer", address]), (peer_cli.app, ["health", "--peer", address])):
            res = runner.invoke(app, [*argv, "--tls", theirs, "--json"])
            assert res.exit_code == exits.REFUSED, (argv, res.output)
            assert json.loads(res.stdout)["code"] == exits.REFUSED
        res = runner.invoke(coord_cli.app, ["runs", "-c", address, "--tls", str(tmp_path / "ours" / "operator")])
        assert res.exit_code == exits.OK, res.output
    finally:
        stop.set()
        thread.join(30)
