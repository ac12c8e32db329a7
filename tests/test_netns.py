"""The multi-host trial: each daemon in its own network namespace with its own address, a link
taken down and the coordinator killed mid-run; every run ends with the undisturbed final model.
Needs root and iproute2; skipped with the reason otherwise (CI runs as root)."""

from __future__ import annotations

import subprocess

import pytest

from bench.common import deploy_script

netns_trial = deploy_script("netns_trial")

OK, WHY = netns_trial.netns_available()


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_faults_across_namespaces_leave_the_final_model_unchanged(tmp_path, idx_source):
    report = tmp_path / "FAULTS.md"
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    rc = netns_trial.main(["--sites", "3", "--workdir", str(tmp_path / "w"), "--source", str(idx_source),
                           "--faults", "link-down,kill-coordinator", "--link-down-seconds", "3", "--baseline-runs", "1",
                           "--subnet", "78", "--report", str(report),
                           "--", "--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1"])
    assert rc == 0
    text = report.read_text()
    assert text.count("| finished |") == 3 and "**no**" not in text
    assert "link of site-" in text and "kill -9 coordinator" in text
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {n for n in after - before if n.startswith("fr")}  # every namespace removed
