"""The run's training recipe as :func:`fedrelay.peer.training_loop.fit` applies it to each model it
trains: the learning-rate schedule (``--lr-schedule``, :func:`schedule`) and the train-time
augmentation (``--augment``, :func:`augmenting`). Both read ``TrainConfig.lr_schedule`` and
``TrainConfig.augment`` (``fedrelay.registry.RECIPE_OPTIONS``); at their defaults (``constant``,
``none``) they return what they were given and change nothing: no scheduler, no extra draw.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedrelay import tasks
from fedrelay.task import Task

__all__ = ["cosine_factor", "schedule", "augmenting"]


def cosine_factor(step: int, total: int) -> float:
    """The cosine schedule's multiplier of ``--lr`` for optimiser step ``step`` (0-based) of
    ``total``: ``0.5 * (1 + cos(pi * step / total))``; 1 at step 0, falling to 0 at ``total``
    (the last step, ``total - 1``, still moves: ``0.5 * (1 + cos(pi * (total - 1) / total))``).
    Steps beyond ``total`` stay at 0. SGDR without restarts (Loshchilov & Hutter, ICLR 2017, Eq. 5,
    with eta_min = 0)."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(1, total)))


def schedule(optimizer: torch.optim.Optimizer, lr_schedule: str, total_steps: int):
    """Attach ``lr_schedule`` to ``optimizer`` (a fresh one, for one model's training of
    ``total_steps`` optimiser steps = epochs x batches per epoch): ``"constant"`` does nothing and
    returns None; ``"cosine"`` returns a ``torch.optim.lr_scheduler.LambdaLR`` of
    :func:`cosine_factor` stepped by a post-step hook of ``optimizer`` after every
    ``optimizer.step()`` (so the training loop itself is unchanged; under DP-SGD,
    ``fedrelay.peer.privacy.DPTraining`` steps this same optimiser once per Poisson batch, and the
    schedule follows its ``epochs x ceil(n / batch_size)`` steps the same way).

    Raises:
        ValueError: an unknown schedule (the message names ``--lr-schedule``).
    """
    if lr_schedule == "constant":
        return None
    if lr_schedule != "cosine":
        raise ValueError(f"--lr-schedule must be constant or cosine, got {lr_schedule!r}")
    total = max(1, int(total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_factor(step, total))
    optimizer.register_step_post_hook(lambda *_: scheduler.step())
    return scheduler


class _Augmenting:
    """``task`` with :meth:`batch` followed, for training batches, by ``task.augment(...,
    method=...)``; every other attribute is ``task``'s."""

    def __init__(self, task: Task, method: str):
        self._task, self._method = task, method
        self.__wrapped__ = task  # so that messages name the task, not this stand-in (tasks.name_of)

    def batch(self, inputs: Tensor, *, train: bool, generator: torch.Generator | None = None) -> Tensor:
        x = self._task.batch(inputs, train=train, generator=generator)
        if not train:
            return x
        out = self._task.augment(x, method=self._method, generator=generator)
        if not isinstance(out, Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"the augmentation {self._method!r} of task {tasks.name_of(self._task)!r} returned {got}, "
                             f"not its input's {x.dtype} {tuple(x.shape)}")
        return out

    def __getattr__(self, name: str):
        return getattr(self._task, name)


def augmenting(task: Task, augment: str):
    """``task`` itself when ``augment == "none"``; otherwise a stand-in whose
    ``batch(rows, train=True, generator=g)`` is ``task.augment(task.batch(...), method=augment,
    generator=g)`` (training batches only: ``train=False`` batches, validation and evaluation, are
    ``task.batch``'s), and whose other attributes are ``task``'s.

    Raises:
        ValueError: the task does not offer ``augment`` (:attr:`fedrelay.Task.augmentations`):
            the message names ``--augment``, the task and what it offers.
    """
    if augment == "none":
        return task
    offered = tuple(getattr(task, "augmentations", ()))
    if augment not in offered:
        raise ValueError(f"--augment {augment}: task {tasks.name_of(task)!r} has no train-time augmentation "
                         f"{augment!r} (it offers: {', '.join(offered) or 'none'}); use --augment "
                         f"{' or --augment '.join(('none',) + offered)}")
    return _Augmenting(task, augment)
