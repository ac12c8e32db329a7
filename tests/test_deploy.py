"""deploy/: the systemd env files and units, the site kit (`coordinator enroll --kit`), the
container files. The env files are parsed the way systemd parses an EnvironmentFile, the unit's
ExecStart is expanded the way systemd expands it, and `peer serve --check` validates the result."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
DOCKER = ROOT / "deploy" / "docker"
BIN = Path(sys.executable).parent


# -- systemd's rules (systemd 252, src/basic/env-file.c and the ExecStart= rules of systemd.service(5))

def parse_environment_file(text: str) -> dict[str, str]:
    """KEY=VALUE per line; lines starting (after blanks) with '#' or ';' are comments, and only
    those: a '#' after a value is part of the value. A backslash at the end of a line joins the
    next one. Unquoted values lose surrounding blanks and a backslash escapes the next character;
    '...' is literal; "..." knows the escapes \\" \\\\ \\` \\$."""
    env: dict[str, str] = {}
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and not line.endswith("\\\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + lines[i]
        i += 1
        s = line.lstrip(" \t")
        if not s or s[0] in "#;":
            continue
        key, sep, raw = s.partition("=")
        key = key.strip(" \t")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"systemd ignores the line {line!r}"
        raw = raw.lstrip(" \t")
        value, j = "", 0
        if raw[:1] == "'":
            end = raw.index("'", 1)
            value = raw[1:end]
        elif raw[:1] == '"':
            j = 1
            while raw[j] != '"':
                if raw[j] == "\\" and raw[j + 1] in '"\\`$':
                    j += 1
                value += raw[j]
                j += 1
        else:
            while j < len(raw):
                if raw[j] == "\\" and j + 1 < len(raw):
                    j += 1
                value += raw[j]
                j += 1
            value = value.rstrip(" \t")
        env[key] = value
    return env


def exec_start(unit_text: str, env: dict[str, str]) -> list[str]:
    """The argv of a unit's ExecStart= (continuation lines joined) with ``${VAR}`` words replaced
    by exactly one argument each, as systemd does (the words here carry no quotes)."""
    joined = re.sub(r"\\\n\s*", " ", unit_text)
    line = next(ln for ln in joined.splitlines() if ln.startswith("ExecStart="))
    argv = []
    for word in line[len("ExecStart="):].split():
        m = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", word)
        argv.append(env.get(m.group(1), "") if m else word)
    return argv


def unit_vars(unit_text: str) -> set[str]:
    """The ${VAR} names a unit's settings (not its comments) use."""
    return set(re.findall(r"\$\{(\w+)\}", "\n".join(ln for ln in unit_text.splitlines() if not ln.startswith("#"))))


def test_parser_keeps_inline_comments_as_systemd_does():
    env = parse_environment_file("# c\n; c\n  A=auto   # auto | cpu\nB = 'x y' \nC=\"a\\\"b\"\nD=a\\\nb\n")
    assert env == {"A": "auto   # auto | cpu", "B": "x y", "C": 'a"b', "D": "ab"}


@pytest.mark.parametrize("name", ["peer.env.example", "coordinator.env.example"])
def test_env_files_have_no_inline_comments(name):
    env = parse_environment_file((SYSTEMD / name).read_text())
    assert env
    for key, value in env.items():
        assert "#" not in value and value == value.strip() and " " not in value, (key, value)
    unit = (SYSTEMD / ("fedrelay-peer.service" if name.startswith("peer") else "fedrelay-coordinator.service")).read_text()
    used = unit_vars(unit)
    assert used <= set(env) | {"FEDRELAY_LISTEN"}, used - set(env)


def test_kit_unit_is_the_deployed_unit():
    from fedrelay.coordinator.kit import PEER_UNIT

    assert PEER_UNIT == (SYSTEMD / "fedrelay-peer.service").read_text()


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A PKI, and a site kit for site-00 (the three_sites fixture's first site's name), made as a
    real site gets one: the site's own key and request (`peer init`, in ``site-tls`` beside the
    kit), the request signed into the kit (`enroll --csr --kit`), the kit's certificates put
    beside the key (`peer install-cert`)."""
    from fedrelay.cli.coordinator import app
    from fedrelay.cli.peer import app as peer_app

    tmp = tmp_path_factory.mktemp("kit")
    runner = CliRunner()
    assert runner.invoke(app, ["init-ca", "--out", str(tmp / "pki")]).exit_code == 0
    r = runner.invoke(peer_app, ["init", "--name", "site-00", "--tls", str(tmp / "site-tls"),
                                 "--host", "site-00.example.org"])
    assert r.exit_code == 0, r.output
    no_csr = runner.invoke(app, ["enroll", "site-00", "--ca", str(tmp / "pki"), "--out", str(tmp / "kit"), "--kit"])
    assert no_csr.exit_code == 2 and "--kit needs --csr" in no_csr.output
    csr = str(tmp / "site-tls" / "site-00.csr")
    r = runner.invoke(app, ["enroll", "--csr", csr, "--ca", str(tmp / "pki"), "--out", str(tmp / "kit"), "--kit",
                            "--coordinator", "coord.example.org:50070"])
    assert r.exit_code == 0, r.output
    again = runner.invoke(app, ["enroll", "--csr", csr, "--ca", str(tmp / "pki"), "--out", str(tmp / "kit"), "--kit"])
    assert again.exit_code == 2 and "--force" in again.output
    r = runner.invoke(peer_app, ["install-cert", str(tmp / "kit"), "--tls", str(tmp / "site-tls")])
    assert r.exit_code == 0, r.output
    return tmp / "kit"


def test_kit_contents(kit):
    # No private key: the site made its own (`peer init`), and it stays in the site's folder.
    assert {p.name for p in kit.iterdir()} == {"cert.pem", "ca.pem", "peer.env", "fedrelay-peer.service",
                                               "start-peer.sh", "README.md"}
    assert stat.S_IMODE((kit.parent / "site-tls" / "key.pem").stat().st_mode) == 0o600
    assert os.access(kit / "start-peer.sh", os.X_OK)
    env = parse_environment_file((kit / "peer.env").read_text())
    assert env["FEDRELAY_COORDINATOR"] == "coord.example.org:50070"
    assert env["FEDRELAY_ADVERTISE"] == "site-00.example.org:50071" and env["FEDRELAY_NAME"] == "site-00"
    # FEDRELAY_OUTBOUND_ONLY is read by `peer serve` from the environment systemd gives it.
    assert unit_vars((kit / "fedrelay-peer.service").read_text()) == set(env) - {"FEDRELAY_OUTBOUND_ONLY"}
    assert env["FEDRELAY_OUTBOUND_ONLY"] == "0"
    readme = (kit / "README.md").read_text()
    for words in ("inbound", "outbound", "TCP 50071", "peer health", "peer status", "install -D", "--check"):
        assert words in readme, words


def _edited(env: dict[str, str], site: Path, state: Path, tls: Path) -> dict[str, str]:
    """What an administrator changes after installing: the paths of this host (the test's)."""
    return {**env, "FEDRELAY_DATA": str(site), "FEDRELAY_STATE_DIR": str(state), "FEDRELAY_TLS": str(tls),
            "FEDRELAY_DEVICE": env["FEDRELAY_DEVICE"] if env["FEDRELAY_DEVICE"] != "auto" else "cpu"}


def test_kit_env_starts_peer_check_under_systemd_rules(kit, three_sites, tmp_path):
    """The kit's unit + peer.env, expanded as systemd would, pass `peer serve --check`; the old
    example's inline comment is refused with a clear message; start-peer.sh does the same."""
    from fedrelay.cli.peer import app

    tls = kit.parent / "site-tls"
    env = _edited(parse_environment_file((kit / "peer.env").read_text()), three_sites[0], tmp_path / "state", tls)
    argv = exec_start((kit / "fedrelay-peer.service").read_text(), env)
    assert argv[:2] == ["/opt/fedrelay/bin/peer", "serve"]
    runner = CliRunner()
    r = runner.invoke(app, argv[1:] + ["--check"], env={"FEDRELAY_TLS": None, "FEDRELAY_COORDINATOR": None})
    assert r.exit_code == 0, r.output
    assert "ok: site site-00" in r.output and "site-00.example.org:50071" in r.output

    bad = parse_environment_file((kit / "peer.env").read_text().replace("FEDRELAY_DEVICE=auto",
                                                                         "FEDRELAY_DEVICE=auto   # auto | cpu"))
    bad = {**_edited(bad, three_sites[0], tmp_path / "state", tls), "FEDRELAY_DEVICE": bad["FEDRELAY_DEVICE"]}
    r = runner.invoke(app, exec_start((kit / "fedrelay-peer.service").read_text(), bad)[1:] + ["--check"])
    assert r.exit_code == 2 and "--device must be auto, cpu or cuda:N" in r.output

    env_file = tmp_path / "peer.env"
    env_file.write_text("\n".join(f"{k}={v}" for k, v in env.items()) + "\n")
    run = subprocess.run([str(kit / "start-peer.sh"), str(env_file), "--check"], capture_output=True, text=True,
                         env={**os.environ, "PEER": str(BIN / "peer")}, timeout=120)
    assert run.returncode == 0 and "ok: site site-00" in run.stdout, run.stdout + run.stderr


def test_outbound_only_kit_opens_no_inbound_port_and_passes_check(three_sites, tmp_path):
    """`enroll --kit --outbound-only`: peer.env sets FEDRELAY_OUTBOUND_ONLY=1, advertises nothing
    and listens on loopback; its README opens no inbound port; under systemd's rules the daemon's
    options pass `peer serve --check`, which says the site connects out only."""
    from fedrelay.cli.coordinator import app as coord
    from fedrelay.cli.peer import app

    runner = CliRunner()
    assert runner.invoke(coord, ["init-ca", "--out", str(tmp_path / "pki")]).exit_code == 0
    assert runner.invoke(app, ["init", "--name", "site-00", "--state-dir", str(tmp_path / "state")]).exit_code == 0
    tls = tmp_path / "state" / "tls"  # peer init's default folder
    r = runner.invoke(coord, ["enroll", "--csr", str(tls / "site-00.csr"), "--ca", str(tmp_path / "pki"), "--out",
                              str(tls), "--kit", "--outbound-only", "--coordinator", "coord.example.org:50070"])
    assert r.exit_code == 0, r.output
    kit = tls
    env = parse_environment_file((kit / "peer.env").read_text())
    assert env["FEDRELAY_OUTBOUND_ONLY"] == "1" and env["FEDRELAY_ADVERTISE"] == ""
    assert env["FEDRELAY_LISTEN"].startswith("127.0.0.1:")
    readme = (kit / "README.md").read_text()
    assert "| inbound | nobody | none |" in readme and "TCP 50071" not in readme and "relay" in readme
    env = _edited(env, three_sites[0], tmp_path / "state", kit)
    argv = exec_start((kit / "fedrelay-peer.service").read_text(), env)
    r = runner.invoke(app, argv[1:] + ["--check"], env={"FEDRELAY_OUTBOUND_ONLY": env["FEDRELAY_OUTBOUND_ONLY"],
                                                         "FEDRELAY_TLS": None, "FEDRELAY_COORDINATOR": None})
    assert r.exit_code == 0, r.output
    assert "connects out only" in r.output
    r = runner.invoke(coord, ["enroll", "site-01", "--ca", str(tmp_path / "pki"), "--out", str(tmp_path / "x"),
                              "--outbound-only"])
    assert r.exit_code == 2 and "only go with --kit" in r.output


def test_example_env_passes_check(three_sites, tmp_path):
    """deploy/systemd/peer.env.example as systemd reads it, with this host's paths."""
    from fedrelay.cli.coordinator import app as coord
    from fedrelay.cli.peer import app

    env = parse_environment_file((SYSTEMD / "peer.env.example").read_text())
    runner = CliRunner()
    assert runner.invoke(coord, ["init-ca", "--out", str(tmp_path / "pki")]).exit_code == 0
    assert runner.invoke(coord, ["enroll", env["FEDRELAY_NAME"], "--ca", str(tmp_path / "pki"),
                                 "--out", str(tmp_path / "tls")]).exit_code == 0
    env = _edited(env, three_sites[1], tmp_path / "state", tmp_path / "tls")
    r = runner.invoke(app, exec_start((SYSTEMD / "fedrelay-peer.service").read_text(), env)[1:] + ["--check"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("unit", ["fedrelay-peer.service", "fedrelay-coordinator.service"])
def test_units_hardened_and_valid(unit, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    path = tmp_path / unit
    text = (SYSTEMD / unit).read_text()
    path.write_text(text)
    out = subprocess.run([tool, "security", "--offline=true", str(path)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 4.0, out.stdout
    if unit == "fedrelay-peer.service":  # GPU access: NVIDIA devices visible and allowed
        settings = [ln for ln in text.splitlines() if not ln.startswith("#")]
        assert not any(ln.startswith(("PrivateDevices=", "MemoryDenyWriteExecute=")) for ln in settings)
        assert "DeviceAllow=char-nvidia-frontend rw" in text and "DeviceAllow=/dev/nvidiactl rw" in text
    # verify: the unit's syntax; its binary replaced by one that exists here
    path.write_text(text.replace("/opt/fedrelay/bin/", f"{BIN}/"))
    out = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and unit not in out.stderr, out.stderr


# -- containers: static checks (no container engine builds images in this sandbox)

def test_dockerignore_and_dockerfile_layers():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "demo", ".fedrelay", "trial", "bench/cache"):
        assert entry in ignored, entry
    steps = [ln.split()[0:2] for ln in (DOCKER / "Dockerfile").read_text().splitlines()
             if ln and not ln.startswith((" ", "#"))]
    text = (DOCKER / "Dockerfile").read_text()
    first_code = text.index("COPY fedrelay ")
    assert text.index("COPY pyproject.toml") < text.index("pip install -r") < first_code
    assert "pip install --no-deps ." in text[first_code:]
    assert ["ARG", "TORCH_INDEX=\"\""] in steps and "HEALTHCHECK" in [s[0] for s in steps]
    assert "fedrelay-healthcheck" in text and (DOCKER / "healthcheck.sh").stat().st_mode & stat.S_IXUSR


def test_compose_never_loosens_keys():
    """Text checks (no YAML parser among the dependencies): the pki script tightens, never
    loosens; every other service mounts only its own key folder, read-only; models land in a
    mounted folder."""
    text = (DOCKER / "compose.yaml").read_text()
    assert "a+r" not in text and "chmod -R" not in text and "o+r" not in text
    assert "chown -R 10001:10001" in text and "/pki/sites/*/key.pem" in text
    mounts = re.findall(r'"\.\./\.\./trial/pki([^"]*)"', text)
    assert mounts.count(":/pki") == 1  # the pki service's own
    assert all(m.endswith(":/tls:ro") for m in mounts if m != ":/pki"), mounts
    assert '"../../trial/models:/models"' in text and "working_dir: /models" in text
