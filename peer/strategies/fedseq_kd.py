"""``fedseq-kd``: the FedSeq chain with distillation towards the received model. fedrelay's own
ablation of its extension ``fedelmy-kd``, **not in any paper's method** (docs/explanation/fedelmy-kd.md).

A FedSeq visit (:func:`fedrelay.peer.strategies.fedseq.train_fedseq`: one model from the received
``m0``, ``S*E`` epochs, the same optimiser, batch order, selection and seeds) whose model trains,
per batch, on ``fedelmy-kd``'s loss (:class:`~fedrelay.peer.strategies.fedelmy_kd.ForgettingLoss`)

    ``L = CE_seen + kd_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))``

with the received model as the teacher (none at a run's first site). It is ``fedelmy-kd``
without the model pool: no average with ``m0``, no d1 or d2. It is also the chain that issue #25's
probe ran outside the project (FedSeq + KL at temperature 2, weight 3 without the ``T^2``
factor, i.e. ``kd_weight = 0.75`` here), so a study can tell what the pool adds to the
distillation. With ``kd_weight = 0`` and ``kd_ce_classes = "all"`` the visit is FedSeq's, bit for
bit.

Options: ``fedelmy-kd``'s (``kd_weight``, ``kd_temperature``, ``kd_ce_classes``; declared once
in :mod:`fedrelay.registry`, with the same defaults). Not available under differential privacy,
for the same reason as ``fedelmy-kd``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from fedrelay.models import ModelSpec, expected_signature

from ..model_pool import ModelCallback, fill_pool
from ..site_data import check_site_data
from ..states import State
from ..train_config import TrainConfig
from ..training_loop import EpochCallback
from . import fedseq
from .fedelmy_kd import forgetting_loss

__all__ = ["train", "models_to_keep"]


def train(m0: Mapping[str, Tensor], spec: ModelSpec, train, val, cfg: TrainConfig, seed: int, device, *,
          finished: Sequence[Mapping[str, Tensor]] = (), on_epoch: EpochCallback | None = None,
          on_model: ModelCallback | None = None, options: Mapping[str, object],
          received: bool = True) -> tuple[State, list[State]]:
    """One ``fedseq-kd`` visit: :func:`fedseq.train_fedseq` from ``m0`` with the batch loss of
    :func:`~fedrelay.peer.strategies.fedelmy_kd.forgetting_loss`, sending the trained model.

    Args:
        options: the run's typed options (``fedrelay.params.options``): ``kd_weight``,
            ``kd_temperature``, ``kd_ce_classes``.
        received: whether ``m0`` came from a predecessor (``run_site`` passes it); False at a
            run's first site, where ``m0`` is the warm-up and no distillation term is used.
        finished, on_epoch, on_model: as :func:`fedseq.train` (resume: the one trained state).

    Returns:
        ``(trained, [m0, trained])``, as :func:`fedseq.train`.

    Raises:
        ValueError: bad config, data or states (as :func:`fedseq.train`), or a bad option value
            (named by its flag).
    """
    train, val = check_site_data(spec, train, val)

    def one(j, pool):
        loss = forgetting_loss("fedseq-kd", m0, spec, train[1], device, options=options, received=received)
        return fedseq.train_fedseq(m0, spec, train, val, cfg, seed, device, on_epoch=on_epoch,
                                   batch_loss=loss if loss.active else None)

    pool = fill_pool(m0, expected_signature(spec), models_to_keep(cfg), finished, one, on_model)
    return pool[1], pool


def models_to_keep(cfg: TrainConfig) -> int:
    """As FedSeq: the one trained model (resume)."""
    return fedseq.models_to_keep(cfg)
