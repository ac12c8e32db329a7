"""The one registry of what a run can do: site-side strategies and aggregators.

The CLI's choices, the coordinator's checks and the peer's dispatch all read this table, so a
strategy is added by writing one module and one entry here (README, "Adding a strategy"). The
table itself imports nothing heavy (the coordinator and the CLI never import torch); the
module named by an entry is imported by the peer only when a site runs it (:func:`load`).

A **strategy** module (``fedrelay.peer.strategies.<name>``) provides::

    def train(m0, spec, train, val, cfg, seed, device, *, finished=(), on_epoch=None,
              on_model=None) -> tuple[State, list[State]]
        # one visit's local training from the received model m0: (what the site sends, its pool)
    models_to_keep(cfg) -> int
        # how many intermediate models ``train`` persists through ``on_model`` (resume)
    payload_schema(spec) -> {name: (shape, dtype)}      (optional)
        # what a hop carries, when it is not just the model's own state (e.g. extra tensors);
        # a receiver checks every payload against it before keeping it

An **aggregator** combines several received payloads into one model (the star plans of the
parallel one-shot methods); ``mean`` is the first (``fedrelay.peer.states.average_states``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


ARCHS = ("cnn", "resnet18")  # the model zoo (fedrelay/peer/models.py builds them)


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str    # one line, for --help and README
    plan: str       # the plan it runs on: "chain" (coordinator/plan.py)
    module: str     # what the peer imports to run it


@dataclass(frozen=True)
class Aggregator:
    name: str
    summary: str
    module: str
    function: str


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("fedelmy", "a model pool per site, diversity-regularised (FedELMY, Wang et al. 2024, Alg. 1)",
             "chain", "fedrelay.peer.strategies.fedelmy"),
    Strategy("fedseq", "one model per site, plain cross-entropy for S·E epochs (sequential FL baseline)",
             "chain", "fedrelay.peer.strategies.fedseq"),
)}

AGGREGATORS: dict[str, Aggregator] = {a.name: a for a in (
    Aggregator("mean", "uniform mean of every tensor (FedAvg without weights; FedELMY Eq. 5/6)",
               "fedrelay.peer.states", "average_states"),
)}


def strategy(name: str) -> Strategy:
    """The registered strategy ``name``. Raises ``ValueError`` naming the choices."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}") from None


def aggregator(name: str) -> Aggregator:
    """The registered aggregator ``name``. Raises ``ValueError`` naming the choices."""
    try:
        return AGGREGATORS[name]
    except KeyError:
        raise ValueError(f"unknown aggregator {name!r}: choose one of {', '.join(AGGREGATORS)}") from None


def load(name: str):
    """Import the module that runs strategy ``name`` (peer side; imports torch)."""
    return importlib.import_module(strategy(name).module)


def combine(name: str):
    """The function of aggregator ``name``: ``f(states: list[State]) -> State``."""
    a = aggregator(name)
    return getattr(importlib.import_module(a.module), a.function)
