"""FedELMY for decentralised parallel FL (supplementary Algorithm 2), the aggregation step.

Each site warms up its own model, builds its FedELMY model pool in parallel with the others and
uploads the pool's average ``m_avg^i`` (Alg. 2 lines 1-16); that site side is FedELMY's pool
training (:mod:`fedrelay.peer.strategies.fedelmy`), done elsewhere, so each upload here IS a
pool average.  Line 19: the final model is the uniform mean of the N pool averages,
``m_final = (1/N) Σ_i m_avg^i`` (:func:`fedrelay.peer.states.average_states`: every state
entry, float64 sums in upload order).  No extras.  With missing uploads it is the mean of those
that arrived.  Whether all sites share one initialisation is not specified by the paper
(reference-code §1.8); this step does not care.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedrelay.models import ModelSpec
from ..states import State, average_states
from . import Context, Upload
from ._common import Schema, check_uploads

__all__ = ["extras_schema", "site_extras", "aggregate"]


def extras_schema(spec: ModelSpec, options: dict) -> Schema:
    """No extras: ``{}``."""
    return {}


def site_extras(state, spec: ModelSpec, train, options: dict, device="cpu") -> dict[str, Tensor]:
    """No extras: ``{}``."""
    return {}


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """Alg. 2 line 19: the uniform mean of the uploaded pool averages.

    Raises:
        ValueError: no uploads, a state that does not fit ``ctx.spec``, or extras attached.
    """
    uploads = check_uploads(uploads, ctx.spec, {}, "fedelmy_pfl")
    return average_states([u.state for u in uploads])
