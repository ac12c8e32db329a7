"""One-shot FedAvg: the final model is the mean of the sites' models.

Option ``weighting`` (default ``"samples"``):

* ``"uniform"``: :func:`fedrelay.peer.states.average_states`, the plain mean of every state
  entry (FedELMY Eq. 5/6).  No extras.
* ``"samples"``: FedAvg's weights ``n_k / Σ n``, ``n_k`` the number of train images site k
  trained on, over every state entry (parameters, BatchNorm running statistics and the int64
  ``num_batches_tracked``).  Sums are taken in float64 in upload order and cast back; integer
  entries truncate toward zero like ``average_states``.  Each upload carries the extra
  ``num_samples`` (int64, shape ``(1,)``).

With missing uploads the weights are renormalised over the uploads that arrived.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedrelay import registry
from fedrelay.models import ModelSpec
from ..states import State, average_states
from ..training import check_data
from . import Context, Upload
from ._common import Schema, check_uploads, expected_keys, weighted_mean

__all__ = ["extras_schema", "site_extras", "aggregate"]

WEIGHTINGS = ("uniform", "samples")


def _weighting(options: dict) -> str:
    weighting = registry.with_defaults("mean", options)["weighting"]  # the default: its registry entry
    if weighting not in WEIGHTINGS:
        raise ValueError(f"mean: weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting


def extras_schema(spec: ModelSpec, options: dict) -> Schema:
    """``{"num_samples": ((1,), torch.int64)}`` when ``weighting == "samples"``, else ``{}``."""
    return {"num_samples": ((1,), torch.int64)} if _weighting(options) == "samples" else {}


def site_extras(state, spec: ModelSpec, train, options: dict, device="cpu") -> dict[str, Tensor]:
    """``{"num_samples": tensor([N])}``, N = the images in ``train``, when weighting by samples;
    ``{}`` otherwise.  ``state`` and ``device`` are not used."""
    if _weighting(options) != "samples":
        return {}
    _, labels = check_data(train, "train", allow_empty=False)
    return {"num_samples": torch.tensor([int(labels.shape[0])], dtype=torch.int64)}


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """The (weighted) mean of the uploaded states, in the order given.

    Raises:
        ValueError: no uploads, a state that does not fit ``ctx.spec``, extras that do not
            match :func:`extras_schema`, or a ``num_samples`` below 1.
    """
    weighting = _weighting(ctx.options)
    uploads = check_uploads(uploads, ctx.spec, extras_schema(ctx.spec, ctx.options), "mean")
    if weighting == "uniform":
        return average_states([u.state for u in uploads])
    weights = []
    for u in uploads:
        n = int(u.extras["num_samples"][0])
        if n < 1:
            raise ValueError(f"mean: site {u.site!r} reports num_samples = {n}; it must be >= 1")
        weights.append(n)
    return {k: weighted_mean([u.state[k] for u in uploads], weights) for k in expected_keys(ctx.spec)}
