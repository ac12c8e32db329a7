"""Aggregators of the parallel one-shot methods: what a site sends, and how sites' models combine.

In a *star* run every site trains on its own data in parallel and uploads its model (plus, for
some methods, extra tensors computed over its own data); an aggregating site combines the
uploads into the final model.  Each method is one module ``fedrelay.peer.aggregators.<name>``:

* ``mean`` (:mod:`.mean`): one-shot FedAvg, uniform or weighted by sample counts.
* ``fedelmy_pfl`` (:mod:`.fedelmy_pfl`): FedELMY's decentralised PFL variant (supplementary
  Alg. 2, line 19): the uniform mean of the sites' pool averages.
* ``maecho`` (:mod:`.maecho`): MA-Echo (Alg. 1), null-space projection echoes (the sites'
  projection matrices in :mod:`.maecho_projectors`).
* ``class_aware`` (:mod:`.class_aware`): MA-Echo's class-aware mean alone (its initial step,
  shared with ``maecho``): FedAvg with a class-aware classifier head, the ablation
  ``fedavg-classaware``.
* ``ofasd`` (:mod:`.ofasd`): OFASD (Alg. 1), block-wise task-vector coefficients distilled
  from the ensemble (its transfer data in :mod:`.ofasd_transfer`).

Every module provides::

    def extras_schema(spec: ModelSpec, options: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]
        # the extra tensors every upload carries (names without the EXTRA prefix); {} when none
    def site_extras(state, spec, train, options, device="cpu") -> dict[str, Tensor]
        # what a site computes after its local training, over its own train split
    def aggregate(uploads: Sequence[Upload], ctx: Context) -> State
        # the final model: exactly the run model's keys, shapes and dtypes (new contiguous CPU tensors)

``options`` (and ``Context.options``) is the run's typed option dict (``fedrelay.params.options``):
the options the module's registry entry declares (``fedrelay.registry.Aggregator.options``), each
given or at its declared default, already checked against its declaration, plus the run's own
(``init``, the DP options, the plan's ``upload_timeout``). Called directly, a module fills what
is missing with ``fedrelay.registry.with_defaults``.

All of this is pure computation: no files, no network.  On the CPU every function is
deterministic (same inputs and seed, bit-identical output); uploads are combined in the order
given (the caller sorts them by site), and any number of them from one up works (a dead site's
upload is simply missing).  Bad input raises ``ValueError``.

A payload on the wire is one flat ``{name: tensor}`` dict (safetensors): the model's state
entries under their own names and the extras under ``EXTRA + name`` (:func:`join_payload`,
:func:`split_payload`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from fedrelay import registry
from fedrelay.models import ModelSpec
from ..states import State
from ..training import TrainConfig

__all__ = ["EXTRA", "METHODS", "Upload", "Context", "split_payload", "join_payload"]

EXTRA = "extra."  # prefix of every extra tensor's name inside a payload (safetensors dict)

# The modules of this package, by name, as the registry's entries name them (fedrelay/registry.py).
METHODS = tuple(a.module.rpartition(".")[2] for a in registry.AGGREGATORS.values() if a.module.startswith(__name__ + "."))


@dataclass(frozen=True)
class Upload:
    """One site's contribution.

    Attributes:
        site: the site's name (only used in error messages and for duplicate detection).
        state: the model's state dict (exactly the run model's keys).
        extras: the aggregator's extra tensors, names WITHOUT the :data:`EXTRA` prefix.
    """

    site: str
    state: State
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Context:
    """What the aggregating site knows besides the uploads.

    Attributes:
        spec: the run's model.
        initial: θ0, the run's shared initial model (None if the sites used independent inits).
        train: the aggregating site's OWN train split ``(uint8 N x C x H x W, int64 N)``.
        val: its validation split (may be empty).
        cfg: the run's training parameters (``batch_size``, ``lr``, ``weight_decay``, ...).
        options: method options (see each module), already range-checked by the caller.
        seed: the aggregation's seed (OFASD's batch order).
        device: where the computation runs.
        on_epoch: progress callback, same keys as :func:`fedrelay.peer.training.fit`'s
            ``on_epoch`` with ``stage="aggregate"``.
    """

    spec: ModelSpec
    initial: State | None
    train: tuple[Tensor, Tensor]
    val: tuple[Tensor, Tensor]
    cfg: TrainConfig
    options: dict
    seed: int
    device: str = "cpu"
    on_epoch: Callable[[dict], None] | None = None


def split_payload(payload: Mapping[str, Tensor]) -> tuple[State, dict[str, Tensor]]:
    """Split a received payload into ``(state, extras)``; extras lose the :data:`EXTRA` prefix.

    The key order of ``payload`` is kept within each part.  Raises ``ValueError`` for a key
    that is exactly the prefix (an extra without a name).
    """
    state: State = {}
    extras: dict[str, Tensor] = {}
    for name, tensor in payload.items():
        if name.startswith(EXTRA):
            short = name[len(EXTRA):]
            if not short:
                raise ValueError(f"payload entry {name!r} is an extra without a name")
            extras[short] = tensor
        else:
            state[name] = tensor
    return state, extras


def join_payload(state: Mapping[str, Tensor], extras: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The payload to send: ``state``'s entries, then each extra under ``EXTRA + name``.

    Raises ``ValueError`` when a state entry's name starts with :data:`EXTRA` (it would be read
    back as an extra) or an extra's name is empty.
    """
    payload: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(EXTRA):
            raise ValueError(f"state entry {name!r} starts with the extras prefix {EXTRA!r}")
        payload[name] = tensor
    for name, tensor in extras.items():
        if not name:
            raise ValueError("an extra tensor needs a name")
        payload[EXTRA + name] = tensor
    return payload
