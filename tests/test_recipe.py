"""The run's training recipe that every method shares (issue #25, item 1): ``--lr-schedule``
(cosine per optimiser step), ``--augment`` (a task hook; image-folder's flip-crop) and the
``cnn-wide`` model; at their defaults nothing changes (tests/test_training.py keeps the digests)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from fedrelay import params, registry
from fedrelay.cli import exits
from fedrelay.peer import recipe
from fedrelay.peer.training import TrainConfig
from fedrelay.peer.training_loop import fit
from fedrelay.task import Task
from fedrelay.tasks.image_folder import ImageFolderTask, spec as image_spec
from fedrelay.tasks.image_folder.augment import flip_crop
from fedrelay.tasks.image_folder.models import build
from fedrelay.tasks.tabular_csv import TabularCsvTask
from conftest import flat, invoke_coordinator as invoke

BASE = dict(strategy="fedseq", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0, lr=1e-3,
            batch_size=32, weight_decay=0.0, selection="last-epoch")


class Recording(ImageFolderTask):
    """image-folder, recording the learning rate of every optimiser step, the raw rows of every
    training batch and every batch the augmentation sees."""

    def __init__(self):
        self.lrs, self.rows, self.augmented = [], [], []

    def optimizer(self, params, *, lr, weight_decay):
        opt = super().optimizer(params, lr=lr, weight_decay=weight_decay)
        opt.register_step_pre_hook(lambda o, *_: self.lrs.append(o.param_groups[0]["lr"]))
        return opt

    def batch(self, inputs, *, train, generator=None):
        if train:
            self.rows.append(inputs.clone())
        return super().batch(inputs, train=train, generator=generator)

    def augment(self, inputs, *, method, generator):
        self.augmented.append(inputs.shape[0])
        return super().augment(inputs, method=method, generator=generator)


def _data(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 255, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    return x, torch.arange(n) % 3


def _fit(task, cfg: TrainConfig, epochs: int = 2, val=None):
    torch.manual_seed(0)
    model = build("cnn", 1, (8, 8), 3)
    empty = (torch.zeros((0, 1, 8, 8), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64))
    return fit(model, _data(), val or empty, cfg, torch.Generator().manual_seed(3), "cpu", epochs=epochs,
               stage="local", index=1, task=task)


# --------------------------------------------------------------------------- learning-rate schedule


def test_cosine_anneals_each_fit_per_optimiser_step_from_lr_towards_zero(one_torch_thread):
    task = Recording()
    cfg = TrainConfig(lr=0.01, batch_size=16, lr_schedule="cosine")
    _fit(task, cfg, epochs=2)
    steps = 2 * math.ceil(40 / 16)  # epochs x batches (the last partial batch included)
    assert len(task.lrs) == steps
    assert task.lrs[0] == 0.01  # the first step at --lr
    assert task.lrs[-1] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * (steps - 1) / steps)), rel=1e-12)
    assert all(a > b > 0 for a, b in zip(task.lrs, task.lrs[1:]))
    task.lrs.clear()
    _fit(task, cfg, epochs=1)  # another fit call: a cycle of its own, from --lr again
    assert task.lrs[0] == 0.01 and len(task.lrs) == 3


def test_constant_schedule_attaches_nothing_and_keeps_lr(one_torch_thread):
    opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=0.5)
    assert recipe.schedule(opt, "constant", 10) is None and "initial_lr" not in opt.param_groups[0]
    with pytest.raises(ValueError, match="--lr-schedule"):
        recipe.schedule(opt, "linear", 10)
    task = Recording()
    _fit(task, TrainConfig(lr=0.01, batch_size=16))
    assert task.lrs == [0.01] * 6


def test_at_the_defaults_fit_is_the_plain_loop_bit_for_bit(one_torch_thread):
    """constant + none: no scheduler, no augmentation, no extra draw: the same weights as the
    plain loop (Adam at --lr, randperm batches, train_one_epoch) written out here."""
    from fedrelay.peer.training_loop import train_one_epoch

    task, cfg = ImageFolderTask(), TrainConfig(lr=0.01, batch_size=16, selection="last-epoch")
    state = _fit(task, cfg, epochs=2)
    torch.manual_seed(0)
    model = build("cnn", 1, (8, 8), 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=cfg.weight_decay)
    g, (x, y) = torch.Generator().manual_seed(3), _data()
    for _ in range(2):
        train_one_epoch(model, opt, x, y, torch.randperm(40, generator=g), 16, task=task)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_cosine_factor_ends_at_zero():
    assert recipe.cosine_factor(0, 7) == 1.0 and recipe.cosine_factor(7, 7) == 0.0 and recipe.cosine_factor(9, 7) == 0.0
    assert recipe.cosine_factor(2, 4) == pytest.approx(0.5)


def test_cosine_steps_under_dp_sgd_too(one_torch_thread, tmp_path):
    pytest.importorskip("opacus")
    from fedrelay import privacy
    from fedrelay.peer import privacy as dp

    task = Recording()
    torch.manual_seed(0)
    model = build("cnn-gn", 1, (8, 8), 3)  # the DP model: no BatchNorm
    cfg = TrainConfig(lr=0.01, batch_size=16, selection="last-epoch", lr_schedule="cosine", augment="flip-crop")
    empty = (torch.zeros((0, 1, 8, 8), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64))
    with dp.engaged(privacy.options({"dp_noise_multiplier": 1.0}), 2, dp.Book(tmp_path / privacy.BOOK)):
        fit(model, _data(), empty, cfg, torch.Generator().manual_seed(3), "cpu", epochs=2, stage="local", index=1,
            task=task)
    steps = 2 * math.ceil(40 / 16)  # DPTraining: ceil(n / batch size) Poisson steps per epoch
    assert len(task.lrs) == steps and task.lrs[0] == 0.01  # every noised step, the schedule with it
    assert all(a > b for a, b in zip(task.lrs, task.lrs[1:]))
    assert task.augmented  # DP-SGD's batches are augmented too


# --------------------------------------------------------------------------- augmentation


def test_flip_crop_is_a_padded_crop_and_a_flip_deterministic_given_the_generator():
    x = torch.rand(9, 3, 6, 5)
    a = flip_crop(x, torch.Generator().manual_seed(1))
    b = flip_crop(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == x.dtype
    assert not torch.equal(a, flip_crop(x, torch.Generator().manual_seed(2)))
    # The same as a loop over the images, drawing in the documented order.
    g = torch.Generator().manual_seed(1)
    dy, dx, flip = (torch.randint(0, 5, (9,), generator=g), torch.randint(0, 5, (9,), generator=g),
                    torch.randint(0, 2, (9,), generator=g))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(9):
        crop = padded[i, :, dy[i]:dy[i] + 6, dx[i]:dx[i] + 5]
        assert torch.equal(a[i], crop.flip(-1) if flip[i] else crop)
    assert flip_crop(x[:0], torch.Generator()).shape == (0, 3, 6, 5)
    with pytest.raises(ValueError, match="N x C x H x W"):
        flip_crop(x[0], torch.Generator())


def test_none_is_the_task_itself_and_the_default_hook_is_the_identity():
    task = ImageFolderTask()
    assert recipe.augmenting(task, "none") is task
    x = torch.rand(2, 1, 4, 4)
    assert Task().augment(x, method="flip-crop", generator=torch.Generator()) is x


def test_messages_name_the_task_not_the_augmenting_stand_in():
    from fedrelay import tasks

    task = ImageFolderTask()
    wrapped = recipe.augmenting(task, "flip-crop")
    assert wrapped is not task and tasks.name_of(wrapped) == tasks.name_of(task) != "_Augmenting"


def test_augment_sees_training_batches_only_and_does_not_shift_the_batch_order(one_torch_thread):
    plain, augmented = Recording(), Recording()
    val = _data(9, seed=1)
    _fit(plain, TrainConfig(batch_size=16), val=val)
    state = _fit(augmented, TrainConfig(batch_size=16, augment="flip-crop"), val=val)
    assert plain.augmented == [] and augmented.augmented == [16, 16, 8] * 2  # train batches, never val
    assert len(plain.rows) == len(augmented.rows) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain.rows, augmented.rows))  # same batches, same order
    again = Recording()
    assert all(torch.equal(state[k], v) for k, v in _fit(again, TrainConfig(batch_size=16, augment="flip-crop"),
                                                         val=val).items())  # reproducible


def test_a_task_without_the_augmentation_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--augment flip-crop: task .* has no train-time augmentation 'flip-crop' "
                                         r"\(it offers: none\); use --augment none"):
        recipe.augmenting(TabularCsvTask(), "flip-crop")
    with pytest.raises(ValueError, match="--augment flip-crop"):
        _fit(Task.__new__(type("Plain", (ImageFolderTask,), {"augmentations": ()})), TrainConfig(augment="flip-crop"))


# --------------------------------------------------------------------------- cnn-wide


def test_cnn_wide_shapes_and_parameters():
    torch.manual_seed(0)
    wide, cnn = build("cnn-wide", 1, (28, 28), 10), build("cnn", 1, (28, 28), 10)
    assert sum(p.numel() for p in wide.parameters()) == 170_074 < sum(p.numel() for p in cnn.parameters())
    assert wide.state_dict().keys() == cnn.state_dict().keys()
    assert wide.state_dict()["features.4.weight"].shape == (64, 32, 3, 3)
    assert wide.state_dict()["classifier.1.weight"].shape == (48, 64 * 7 * 7)
    out = wide(torch.rand(3, 1, 28, 28))
    assert out.shape == (3, 10) and out.dtype == torch.float32
    assert build("cnn-wide", 3, (5, 7), 2)(torch.rand(2, 3, 5, 7)).shape == (2, 2)
    assert "cnn-wide" in registry.ARCHS and "cnn-wide" in ImageFolderTask.models
    assert image_spec("cnn-wide", 1, (8, 8), 3).model == "cnn-wide"


# --------------------------------------------------------------------------- the options


def test_every_strategy_reads_the_recipe_and_the_wire_carries_it():
    for name in registry.STRATEGIES:
        assert {"lr_schedule", "augment"} <= {o.name for o in registry.options_of(name)}
    d = {**BASE, "lr_schedule": "cosine", "augment": "flip-crop"}
    back = params.to_dict(params.to_pb(d))
    params.check(back)
    cfg = TrainConfig(**params.train_config(back))
    assert (cfg.lr_schedule, cfg.augment) == ("cosine", "flip-crop")
    cfg.validate()
    default = TrainConfig(**params.train_config(params.to_dict(params.to_pb(BASE))))
    assert (default.lr_schedule, default.augment) == ("constant", "none")
    assert not params.to_pb(BASE).method_options  # unset: nothing new on the wire
    with pytest.raises(ValueError, match="--lr-schedule must be one of constant, cosine, got 'linear'"):
        params.check({**BASE, "lr_schedule": "linear"})
    with pytest.raises(ValueError, match="--augment must be one of none, flip-crop, got 'mixup'"):
        TrainConfig(augment="mixup").validate()


def test_start_chain_lists_and_checks_the_recipe_flags(tmp_path):
    text = flat(invoke("start-chain", "--help").output)
    assert re.search(r"--lr-schedule <constant\|cosine>.*\[default: constant\]", text)
    assert re.search(r"--augment <none\|flip-crop>.*\[default: none\]", text)
    res = invoke("start-chain", "--seed", "1", "--lr-schedule", "linear", "--insecure")
    assert res.exit_code == exits.USAGE and "--lr-schedule" in res.output
    cfg = tmp_path / "run.toml"
    cfg.write_text('seed = 1\nlr-schedule = "cosine"\naugment = "mixup"\n')
    res = invoke("start-chain", "--config", str(cfg), "--coordinator", "127.0.0.1:9", "--insecure")
    assert res.exit_code == exits.USAGE and "key 'augment' must be one of none, flip-crop, got 'mixup'" in flat(res.output)
    assert "not reachable" not in res.output  # refused before the coordinator is called


@pytest.mark.integration
def test_a_two_site_run_through_the_daemons_with_cosine_flip_crop_and_cnn_wide(three_sites, tmp_path):
    from deploy import local_trial

    cfg = tmp_path / "run.toml"
    cfg.write_text('seed = 3\nmodel = "cnn-wide"\nmodels-per-site = 1\nlocal-epochs = 1\nwarmup-epochs = 1\n'
                   'batch-size = 32\nlr-schedule = "cosine"\naugment = "flip-crop"\n')
    with local_trial.LocalTrial(tmp_path / "trial", three_sites[:2], insecure=True) as trial:
        res = trial.cli("start-chain", "--config", str(cfg), "--wait", "--json", capture_output=True, text=True,
                        timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout)
    assert run["status"] == "finished", run["error"]
    assert (run["params"]["lr_schedule"], run["params"]["augment"]) == ("cosine", "flip-crop")  # the ledger's record
    assert run["arch"] == "cnn-wide"
