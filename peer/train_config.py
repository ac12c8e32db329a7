"""A site's training hyperparameters: :class:`TrainConfig` (checked by :func:`fedrelay.params.check`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fedrelay import params, registry

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one site's local training.

    Attributes:
        strategy: a name in :data:`fedrelay.registry.STRATEGIES`: ``"fedelmy"`` (model
            pool + distance regulariser), ``"fedseq"`` (one model, plain CE), ...
        models_per_site: S, pool models trained per site (FedSeq trains one model for
            S*E epochs so that both spend the same number of epochs).
        local_epochs: E, epochs per pool model.
        warmup_epochs: E_w, plain-CE epochs at the first site only (0 = none).
        alpha: weight of d1 (>= 0).  Reference-code default 1.0.
        beta: weight of d2 (>= 0).  Reference-code default 1.0.
        lr: Adam learning rate.
        batch_size: samples per batch.
        weight_decay: ``torch.optim.Adam(weight_decay=...)``, i.e. coupled L2 (not
            AdamW), as in the reference code.
        selection: ``"best-val"`` keeps the epoch with the strictly best validation
            accuracy (the reference behaviour; a validation pass after every epoch);
            ``"last-epoch"`` keeps the last (validated once, after the last epoch).
        lr_schedule: the run's ``--lr-schedule`` (:data:`fedrelay.registry.LR_SCHEDULES`):
            ``"constant"`` (``lr`` throughout) or ``"cosine"`` (per optimiser step, from ``lr``
            to 0 over each trained model's epochs x batches;
            :func:`fedrelay.peer.training_loop.fit`).
        augment: the run's ``--augment`` (:data:`fedrelay.registry.AUGMENTATIONS`): ``"none"``
            or the name of a train-time augmentation the task offers
            (:attr:`fedrelay.Task.augmentations`, :meth:`fedrelay.Task.augment`).
    """

    strategy: str = "fedelmy"
    models_per_site: int = 5
    local_epochs: int = 2
    warmup_epochs: int = 2
    alpha: float = 1.0
    beta: float = 1.0
    lr: float = 1e-3
    batch_size: int = 128
    weight_decay: float = 1e-4
    selection: str = "best-val"
    lr_schedule: str = "constant"
    augment: str = "none"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, if any, by its start-chain flag
        (:func:`fedrelay.params.check`, the one check of a run's training parameters; the
        recipe's by their declarations, ``fedrelay.registry.RECIPE_OPTIONS``)."""
        fields = dataclasses.asdict(self)
        recipe = {o: fields.pop(o.name) for o in registry.RECIPE_OPTIONS}
        params.check(fields)
        for option, value in recipe.items():
            option.check(value)
