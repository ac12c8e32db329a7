"""``fedelmy-kd``: FedELMY with two terms against forgetting under label skew. fedrelay's own
extension, **not in the FedELMY paper** (docs/explanation/fedelmy-kd.md says what and why).

A FedELMY visit (:func:`fedrelay.peer.strategies.fedelmy.train_pool`: the same pool, start
points, d1, d2, selection and seeds) whose pool models train, per batch, on

    ``L - alpha * d1 / a + beta * d2 / a``  (FedELMY Eq. 9, with ``L`` in place of CE)

    ``L = CE_seen + kd_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))``

* **Distillation towards the received model** (Hinton, Vinyals, Dean 2015, "Distilling the
  Knowledge in a Neural Network", with its ``T^2`` factor): the teacher is ``m0``, the model this
  site received from its predecessor, in eval mode and without gradient, on the same (augmented)
  batch as the student. Not at the first site of a run, where ``m0`` is the site's own warm-up
  (there is nothing received to keep); a later round's first site received the previous round's
  model, and distils towards it.
* **Cross-entropy over the classes the site holds** (``kd_ce_classes="seen"``, opt-in; after the
  restricted softmax of FedRS, Li & Zhan, KDD 2021, which scales the missing classes' logits by
  a factor alpha; here they are left out of the softmax): the softmax of the CE runs over the
  logits of the classes present in the site's training split only, so the site's data do not
  push down the classes it has never seen; their logits are left to the distillation. Nothing
  then ranks the site's classes above the missing ones, which the distillation may keep high
  (docs/explanation/fedelmy-kd.md). ``"all"`` (the default): the task's loss over every class
  (FedELMY's CE).

``a`` (``fedelmy.magnitude_scale``) reads ``L``, so d2 stays about an order of magnitude below
the data terms, as it stays below CE in FedELMY. With ``kd_weight = 0`` and ``kd_ce_classes =
"all"`` (or a site that holds every class, at the first site) ``L`` is the task's loss and the
visit is FedELMY's, bit for bit.

The default weight 0.75 is the probe's of issue #25 ("KL at temperature 2, weight 3") read
without the ``T^2`` factor (3 / T^2 = 0.75); our first default, 3.0, multiplied ``T^2 * KL``
(an effective 12 on the KL) and fell below FedSeq and FedELMY on the full-data chains at S = 1;
0.75 was above 3.0 in every cell paired by seed (the KD-weight study beside the grid in
bench/RESULTS.md, generated from its cells, says by how much and against FedSeq and FedELMY;
docs/explanation/fedelmy-kd.md).

Options (declared in :mod:`fedrelay.registry`, typed and checked before they reach
:func:`train`): ``kd_weight`` (float >= 0, default 0.75), ``kd_temperature`` (float > 0, default
2.0), ``kd_ce_classes`` (``"all"`` | ``"seen"``, default ``"all"``). Not available under
differential privacy (``fedrelay.privacy.check`` refuses it): the set of classes a site holds is
a statistic of its data that DP-SGD does not noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedrelay import tasks
from fedrelay.models import ModelSpec
from fedrelay.task import Task

from ..model_pool import ModelCallback
from ..site_data import check_site_data
from ..states import State, build_loaded
from ..train_config import TrainConfig
from ..training_loop import EpochCallback
from . import fedelmy

__all__ = ["train", "models_to_keep", "forgetting_loss", "ForgettingLoss", "distillation", "seen_classes", "SEEN",
           "ALL"]

SEEN, ALL = "seen", "all"   # kd_ce_classes' choices


def train(m0: Mapping[str, Tensor], spec: ModelSpec, train, val, cfg: TrainConfig, seed: int, device, *,
          finished: Sequence[Mapping[str, Tensor]] = (), on_epoch: EpochCallback | None = None,
          on_model: ModelCallback | None = None, options: Mapping[str, object],
          received: bool = True) -> tuple[State, list[State]]:
    """One ``fedelmy-kd`` visit: FedELMY's pool (:func:`fedelmy.train_pool`, same arguments,
    resume and return value) with the batch loss :class:`ForgettingLoss`.

    Args:
        options: the run's typed options (``fedrelay.params.options``): ``kd_weight``,
            ``kd_temperature``, ``kd_ce_classes``.
        received: whether ``m0`` came from a predecessor (``run_site`` passes it); False at a
            run's first site, where ``m0`` is the warm-up and no distillation term is used.

    Returns:
        ``(average of the pool, pool)`` as :func:`fedelmy.train_pool`.

    Raises:
        ValueError: bad config, data or states (as :func:`fedelmy.train_pool`), or a bad option
            value (named by its flag).
    """
    train, val = check_site_data(spec, train, val)
    loss = forgetting_loss("fedelmy-kd", m0, spec, train[1], device, options=options, received=received)
    return fedelmy.train_pool(m0, spec, train, val, cfg, seed, device, finished=finished, on_epoch=on_epoch,
                              on_model=on_model, batch_loss=loss if loss.active else None)


def forgetting_loss(strategy: str, m0: Mapping[str, Tensor], spec: ModelSpec, labels: Tensor, device, *,
                    options: Mapping[str, object], received: bool) -> "ForgettingLoss":
    """The :class:`ForgettingLoss` of one visit of ``strategy`` (``fedelmy-kd`` or ``fedseq-kd``,
    whose registry entries declare the ``kd_*`` options): the teacher is ``m0`` (eval mode, no
    gradient, on ``device``) when ``received`` and ``kd_weight != 0``; the seen classes are
    those of ``labels`` (int64 ``N``, the site's training labels) when ``kd_ce_classes ==
    "seen"``. Options not given take their declared defaults.

    Raises:
        ValueError: a bad option value (named by its flag).
    """
    from fedrelay import registry

    declared = registry.strategy(strategy).options
    options = {**registry.defaults(declared), **options}
    for option in declared:
        option.check(options[option.name])
    weight, temperature = float(options["kd_weight"]), float(options["kd_temperature"])
    seen = seen_classes(labels, spec.num_classes) if options["kd_ce_classes"] == SEEN else None
    teacher = None
    if received and weight != 0.0:
        teacher = build_loaded(spec, m0).to(device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    return ForgettingLoss(tasks.resolve(spec), teacher=teacher, weight=weight, temperature=temperature, seen=seen)


def models_to_keep(cfg: TrainConfig) -> int:
    """As FedELMY: the S pool models (resume)."""
    return fedelmy.models_to_keep(cfg)


def seen_classes(labels: Tensor, num_classes: int) -> Tensor | None:
    """The classes present in ``labels`` (int64 ``N``, values in ``0 .. num_classes-1``), sorted,
    as an int64 tensor; None when every one of the ``num_classes`` classes is present (the
    restriction is then the identity and is skipped, so the loss is the task's, bit for bit)."""
    present = torch.unique(labels.detach().to("cpu", torch.int64))
    return None if int(present.numel()) >= int(num_classes) else present


def distillation(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over the batch (Hinton
    et al. 2015; the ``T^2`` keeps the gradient's scale independent of ``T``).

    Args:
        student: the trained model's logits, float ``N x K``, with gradient.
        teacher: the teacher's logits, float ``N x K`` (detached by the caller).
        temperature: T > 0.

    Returns:
        A 0-d tensor (the logits' dtype and device), >= 0 up to rounding; in nats.
    """
    t = float(temperature)
    log_student = F.log_softmax(student / t, dim=1)
    log_teacher = F.log_softmax(teacher / t, dim=1)
    return F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * (t * t)


class ForgettingLoss:
    """``fedelmy-kd``'s loss of a batch (:data:`fedrelay.peer.training_loop.BatchLoss`):
    ``CE_seen(outputs, labels) + weight * distillation(outputs, teacher(inputs), temperature)``.

    Args:
        task: the run's task: its loss is CE when ``seen`` is None.
        teacher: the received model (eval mode, on the inputs' device, no gradient), or None: no
            distillation term.
        weight: the distillation's weight (>= 0; 0: no term).
        temperature: T > 0.
        seen: the classes of the site's training split (:func:`seen_classes`), or None: the
            task's loss over every class. Otherwise the mean cross-entropy of the logits of
            these classes only (after FedRS's restricted softmax), the labels renumbered among them.

    :attr:`active` is False when the loss is exactly the task's (no teacher or weight 0, and no
    restriction): the caller then passes no batch loss at all.
    """

    def __init__(self, task: Task, *, teacher: nn.Module | None, weight: float, temperature: float,
                 seen: Tensor | None):
        self.task = task
        self.teacher = teacher if weight != 0.0 else None
        self.weight = float(weight)
        self.temperature = float(temperature)
        self.seen = seen
        self._device = None
        self._index: Tensor | None = None   # class -> position among the seen ones (-1: unseen)
        self.active = self.teacher is not None or self.seen is not None

    def _restricted(self, outputs: Tensor, labels: Tensor) -> Tensor:
        if self._device != outputs.device:
            self.seen = self.seen.to(outputs.device)
            index = torch.full((outputs.shape[1],), -1, dtype=torch.int64)
            index[self.seen.cpu()] = torch.arange(int(self.seen.numel()))
            self._index, self._device = index.to(outputs.device), outputs.device
        return F.cross_entropy(outputs.index_select(1, self.seen), self._index[labels])

    def __call__(self, outputs: Tensor, inputs: Tensor, labels: Tensor) -> Tensor:
        """The loss of one batch: ``outputs`` float ``N x K`` logits (with gradient), ``inputs``
        the batch the model saw, ``labels`` int64 ``N``. Returns a 0-d tensor."""
        loss = self.task.loss(outputs, labels) if self.seen is None else self._restricted(outputs, labels)
        if self.teacher is not None:
            with torch.no_grad():
                target = self.teacher(inputs)
            loss = loss + self.weight * distillation(outputs, target, self.temperature)
        return loss
