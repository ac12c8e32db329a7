"""The command line as a user meets it: clear errors, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)


def test_networked_commands_need_insecure_until_tls_exists(tmp_path):
    for argv in (("coordinator", "serve", "--db", str(tmp_path / "l.sqlite")),
                 ("coordinator", "runs"),
                 ("peer", "serve", "--data", str(tmp_path), "--name", "a")):
        res = run(*argv)
        assert res.returncode == 1
        assert "--insecure" in res.stderr and "Traceback" not in res.stderr


def test_missing_data_folder_is_a_clear_error(tmp_path):
    res = run("peer", "serve", "--data", str(tmp_path / "nowhere"), "--name", "a", "--insecure",
              "--coordinator", "127.0.0.1:9")
    assert res.returncode == 1
    assert "nowhere" in res.stderr and "Traceback" not in res.stderr


def test_empty_site_is_a_clear_error(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    res = run("peer", "serve", "--data", str(tmp_path), "--name", "a", "--insecure", "--coordinator", "127.0.0.1:9")
    assert res.returncode == 1
    assert "no training images" in res.stderr.lower() and "Traceback" not in res.stderr


def test_unreachable_coordinator_is_a_clear_error():
    res = run("coordinator", "runs", "--coordinator", "127.0.0.1:9", "--insecure")
    assert res.returncode == 1
    assert "not reachable" in res.stderr and "Traceback" not in res.stderr


def test_missing_dataset_says_how_to_get_it(tmp_path):
    res = run("coordinator", "split-dataset", "fashion-mnist", "--sites", "2", "--out", str(tmp_path / "o"),
              "--source", str(tmp_path))
    assert res.returncode == 2
    assert "dataset-fashion-mnist" in res.stderr and "Traceback" not in res.stderr
