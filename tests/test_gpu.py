"""Training on a CUDA GPU repeats bit for bit with the peer daemon's default deterministic
kernels. The CUDA tests are skipped on a machine without a GPU (CI's); they were run on an H100."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deploy import local_trial
from test_chain import CHAIN
from fedrelay.peer.training import use_deterministic_kernels

pytestmark = pytest.mark.integration

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_deterministic_kernels_are_switched_on_for_cuda_only(monkeypatch):
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        torch.use_deterministic_algorithms(False)
        assert use_deterministic_kernels("cpu") is False
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert use_deterministic_kernels("cuda:0") is True  # sets flags only: no GPU needed
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


TRAIN_TWICE = """
import hashlib, sys, torch
from fedrelay.models import ModelSpec
from fedrelay.tasks.image_folder import spec as image_spec
from fedrelay.peer.training import TrainConfig, run_site, use_deterministic_kernels
use_deterministic_kernels("cuda:0")
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (600, 1, 28, 28), dtype=torch.uint8, generator=g)
y = torch.randint(0, 10, (600,), generator=g)
cfg = TrainConfig(models_per_site=2, local_epochs=2, warmup_epochs=1)
out = []
for _ in range(2):
    sent, pool = run_site(None, image_spec("cnn", 1, (28, 28), 10), (x[:500], y[:500]), (x[500:], y[500:]),
                          cfg, seed=3, device="cuda:0")
    assert all(t.device.type == "cpu" and t.is_contiguous() for s in (sent, *pool) for t in s.values())
    h = hashlib.sha256()
    for k in sorted(sent):
        h.update(sent[k].numpy().tobytes())
    out.append(h.hexdigest())
print(out[0], out[1])
"""


@cuda
def test_training_on_the_gpu_repeats_bit_for_bit():
    # A fresh process each: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its first handle is made.
    res = subprocess.run([sys.executable, "-c", TRAIN_TWICE], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = res.stdout.split()
    assert first == second


@cuda
def test_a_chain_on_the_gpu_gives_the_same_digests_twice(three_sites, tmp_path):
    with local_trial.LocalTrial(tmp_path, three_sites, device="cuda:0") as trial:
        runs = []
        for _ in range(2):
            res = trial.cli("start-chain", "--seed", "7", "--wait", "--json", *CHAIN,
                            capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
            runs.append(json.loads(res.stdout))
        for name in trial.names:  # the peers trained on the GPU
            assert "device cuda:0" in (trial.logs / f"{name}.log").read_text()
    assert all(r["status"] == "finished" for r in runs)
    assert [h["sha256"] for h in runs[0]["hops"]] == [h["sha256"] for h in runs[1]["hops"]]
    assert runs[0]["final"]["sha256"] == runs[1]["final"]["sha256"]
