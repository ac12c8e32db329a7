"""The command line as a user meets it: clear errors, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)


def test_networked_commands_need_tls_or_insecure(tmp_path):
    for argv in (("coordinator", "serve", "--db", str(tmp_path / "l.sqlite")),
                 ("coordinator", "runs"),
                 ("peer", "serve", "--data", str(tmp_path), "--name", "a"),
                 ("peer", "status", "--peer", "127.0.0.1:9")):
        res = run(*argv)
        assert res.returncode == 2
        assert "--tls" in res.stderr and "--insecure" in res.stderr and "Traceback" not in res.stderr
    res = run("coordinator", "runs", "--tls", str(tmp_path), "--insecure")
    assert res.returncode == 2 and "not both" in res.stderr


def test_tls_folder_errors_are_clear(tmp_path):
    res = run("coordinator", "runs", "--tls", str(tmp_path), "--coordinator", "127.0.0.1:9")
    assert res.returncode == 2 and "key.pem" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "key.pem").write_text("junk")
    (tmp_path / "cert.pem").write_text("junk")
    (tmp_path / "ca.pem").write_text("junk")
    res = run("coordinator", "runs", "--tls", str(tmp_path), "--coordinator", "127.0.0.1:9")
    assert res.returncode == 2 and "PEM" in res.stderr and "Traceback" not in res.stderr


def test_init_ca_and_enroll_write_private_keys_0600(tmp_path):
    import stat

    pki = tmp_path / "pki"
    assert run("coordinator", "init-ca", "--out", str(pki)).returncode == 0
    res = run("coordinator", "enroll", "site-3", "--ca", str(pki), "--out", str(tmp_path / "site-3.pki"),
              "--host", "site3.example.org", "--host", "10.0.0.3")
    assert res.returncode == 0, res.stderr
    for key in (pki / "ca" / "ca-key.pem", pki / "coordinator" / "key.pem", pki / "operator" / "key.pem",
                tmp_path / "site-3.pki" / "key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "site-3.pki" / "cert.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"site-3", "site3.example.org"}
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.3"]
    # Reserved role names and names that are not DNS labels are refused; an existing CA is kept.
    for bad in ("coordinator", "operator", "Site_3"):
        res = run("coordinator", "enroll", bad, "--ca", str(pki), "--out", str(tmp_path / "x"))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    res = run("coordinator", "init-ca", "--out", str(pki))
    assert res.returncode == 2 and "already" in res.stderr
    # --tls with the wrong identity for the daemon is a clear error before anything is served.
    res = run("peer", "serve", "--data", str(tmp_path), "--name", "site-4", "--tls", str(tmp_path / "site-3.pki"))
    assert res.returncode == 2 and "site-3" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = run("coordinator", "serve", "--tls", str(pki / "operator"), "--db", str(tmp_path / "l.sqlite"))
    assert res.returncode == 2 and "operator" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_missing_data_folder_is_a_clear_error(tmp_path):
    res = run("peer", "serve", "--data", str(tmp_path / "nowhere"), "--name", "a", "--insecure",
              "--coordinator", "127.0.0.1:9")
    assert res.returncode == 2
    assert "nowhere" in res.stderr and "Traceback" not in res.stderr


def test_empty_site_is_a_clear_error(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    res = run("peer", "serve", "--data", str(tmp_path), "--name", "a", "--insecure", "--coordinator", "127.0.0.1:9")
    assert res.returncode == 2
    assert "no training images" in res.stderr.lower() and "Traceback" not in res.stderr


def test_unreachable_coordinator_is_a_clear_error():
    res = run("coordinator", "runs", "--coordinator", "127.0.0.1:9", "--insecure")
    assert res.returncode == 3
    assert "not reachable" in res.stderr and "Traceback" not in res.stderr


def test_bad_chain_parameters_are_refused_before_the_coordinator_is_called():
    """``--lr nan`` used to pass every check and leave a failed run in the ledger; the CLI now
    checks every parameter first (the coordinator, unreachable here, is never called)."""
    for flags, words in ((("--lr", "nan"), "--lr must be a finite number"), (("--rounds", "0"), "--rounds"),
                         (("--init", "file"), "--init-weights must be the weights file's SHA-256"),
                         (("--strategy", "ofasd", "--init", "per-site"), "one initial model"),
                         (("--strategy", "maecho", "--maecho-tau", "0"), "--maecho-tau must be between")):
        res = run("coordinator", "start-chain", "--seed", "1", *flags, "--coordinator", "127.0.0.1:9", "--insecure")
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr
        assert "not reachable" not in res.stderr
    # A choice outside the registry is a usage error (exit 2) that lists the choices.
    res = run("coordinator", "start-chain", "--seed", "1", "--strategy", "fedprox", "--coordinator", "127.0.0.1:9",
              "--insecure")
    assert res.returncode == 2 and "fedelmy" in res.stderr and "Traceback" not in res.stderr


def test_missing_dataset_says_how_to_get_it(tmp_path):
    res = run("coordinator", "split-dataset", "fashion-mnist", "--sites", "2", "--out", str(tmp_path / "o"),
              "--source", str(tmp_path))
    assert res.returncode == 2
    assert "dataset-fashion-mnist" in res.stderr and "Traceback" not in res.stderr


def test_sources_compile_without_warnings():
    """Every module compiles with warnings as errors: an invalid escape such as ``"\\["`` in a
    help text is a DeprecationWarning on Python 3.11 (hidden) and a SyntaxWarning printed by every
    command on 3.12 (seen on the GPU machine)."""
    import warnings

    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("fedrelay", "peer", "coordinator", "cli", "bench", "deploy", "tests")
               for p in sorted((root / d).rglob("*.py"))]
    assert len(sources) > 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in sources:
            compile(path.read_text(), str(path), "exec")
