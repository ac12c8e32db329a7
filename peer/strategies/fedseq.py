"""FedSeq: the sequential-FL baseline; one model per site, the task's plain loss (cross-entropy).

Each site trains one model from the received ``m0`` with plain CE for ``S*E`` epochs, the
same local compute as FedELMY (Wang et al., ACM MM 2024, section 4.3.2), and sends it on.
Neither FedSeq nor its hyperparameters are in the reference repository (the authors' code).

Read top to bottom like one visit: :func:`train` (the registry's entry point, with resume)
receives ``m0``, trains with :func:`train_fedseq` and sends the trained model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from fedrelay import tasks

from fedrelay.models import ModelSpec, expected_signature
from ..states import State, build_loaded, check_signature
from ..determinism import derive_seed, seeded_generator
from ..model_pool import ModelCallback, fill_pool
from ..site_data import check_site_data
from ..train_config import TrainConfig
from ..training_loop import BatchLoss, EpochCallback, fit

__all__ = ["train", "models_to_keep", "train_fedseq"]


def train(m0: Mapping[str, Tensor], spec: ModelSpec, train, val, cfg: TrainConfig, seed: int, device, *,
          finished: Sequence[Mapping[str, Tensor]] = (), on_epoch: EpochCallback | None = None,
          on_model: ModelCallback | None = None) -> tuple[State, list[State]]:
    """One FedSeq visit: :func:`train_fedseq` from ``m0``, sending the trained model.

    ``on_model(1, trained)`` is called with the newly trained model so that the caller can
    persist it; on resume ``finished`` may hold that one state, which skips the training.

    Returns:
        ``(trained, [m0, trained])``.

    Raises:
        ValueError: more than one ``finished`` state, a state that does not fit ``spec``, or
            what :func:`train_fedseq` raises.
    """
    pool = fill_pool(m0, expected_signature(spec), models_to_keep(cfg), finished,
                     lambda j, pool: train_fedseq(m0, spec, train, val, cfg, seed, device, on_epoch=on_epoch),
                     on_model)
    return pool[1], pool


def models_to_keep(cfg: TrainConfig) -> int:
    """How many models :func:`train` hands to ``on_model`` (and takes back as ``finished``): 1."""
    return 1


def train_fedseq(m0: Mapping[str, Tensor], spec: ModelSpec, train, val, cfg: TrainConfig, seed: int, device,
                 on_epoch: EpochCallback | None = None, batch_loss: BatchLoss | None = None) -> State:
    """The FedSeq baseline at one site: one model from ``m0``, plain CE, S*E epochs.

    Same optimiser, batching and selection as FedELMY's pool models
    (:func:`fedrelay.peer.training.fit`); batch order from ``derive_seed(seed, "fedseq")``.
    Neither FedSeq nor its hyperparameters are in the reference repository
    (reference-code §1.7); S*E epochs give it the same local compute as
    FedELMY (paper section 4.3.2).  ``on_epoch`` gets ``stage="fedseq"``, ``model=0``,
    ``epochs=S*E``.  ``batch_loss`` (an extension's hook, not the baseline's: ``fedseq-kd``,
    :mod:`fedrelay.peer.strategies.fedseq_kd`) replaces the task's loss of every batch; None
    (the default): plain CE, arithmetic unchanged.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad config or data, or an ``m0`` that does not fit ``spec``.
    """
    cfg.validate()
    train, val = check_site_data(spec, train, val)
    check_signature(m0, expected_signature(spec), "m0")
    model = build_loaded(spec, m0)
    return fit(
        model, train, val, cfg, seeded_generator(derive_seed(seed, "fedseq")), device,
        epochs=cfg.models_per_site * cfg.local_epochs, stage="fedseq", index=0, on_epoch=on_epoch,
        task=tasks.resolve(spec), batch_loss=batch_loss,
    )
