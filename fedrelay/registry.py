"""The one registry of what a run can do: site-side strategies and aggregators.

The CLI's choices, the coordinator's checks and the peer's dispatch all read this table, so a
strategy is added by writing one module and one entry here (docs/development.md, "Adding a strategy"). The
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

A strategy runs on a **plan** (coordinator/plan.py): ``"chain"`` (the model passes from site to
site) or ``"star"`` (the parallel one-shot methods: every site trains with ``train`` from the
run's initial model at once and uploads to one aggregating site, whose **aggregator** combines
the uploads). An aggregator module (``fedrelay.peer.aggregators.<name>``) provides::

    extras_schema(spec, options) -> {name: (shape, dtype)}   # extra tensors every upload carries
    site_extras(state, spec, train, options, device) -> {name: Tensor}   # computed at each site
    aggregate(uploads, ctx) -> State                          # at the aggregating site

The CLI and the coordinator read the names, summaries and plans; only the peer imports modules.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


ARCHS = ("cnn", "resnet18", "cnn-gn")  # the model zoo (fedrelay/tasks/image_folder/models.py builds them)


CHAIN, STAR = "chain", "star"


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str    # one line, for --help and the docs
    plan: str       # the plan it runs on: "chain" or "star" (coordinator/plan.py)
    module: str     # what the peer imports to run a site's local training
    aggregator: str = ""   # star plans: the aggregator (AGGREGATORS) the aggregating site runs
    init: str = "shared"   # the initial model when --init is not given (fedrelay/params.py INITS)


@dataclass(frozen=True)
class Aggregator:
    name: str
    summary: str
    module: str


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("fedelmy", "a model pool per site, diversity-regularised (FedELMY, Wang et al. 2024, Alg. 1)",
             CHAIN, "fedrelay.peer.strategies.fedelmy"),
    Strategy("fedseq", "one model per site, plain cross-entropy for S·E epochs (sequential FL baseline)",
             CHAIN, "fedrelay.peer.strategies.fedseq"),
    Strategy("fedavg", "one-shot FedAvg: every site trains one model in parallel, the aggregator averages them",
             STAR, "fedrelay.peer.strategies.fedseq", aggregator="mean"),
    # Supplementary Alg. 2 warms up "a randomly initialized model" per client and does not say
    # whether they share the init; independent inits (--init per-site) average to chance-level
    # accuracy (tests/test_star.py; bench/RESULTS.md), so the default is one shared init.
    Strategy("fedelmy-pfl", "FedELMY's parallel adaptation: a model pool per site in parallel, the mean of the "
             "pool averages (supplementary Alg. 2)", STAR, "fedrelay.peer.strategies.fedelmy",
             aggregator="fedelmy-pfl"),
    Strategy("maecho", "MA-Echo: local models plus per-layer projection matrices, combined by null-space "
             "echo iterations (Su et al., Alg. 1)", STAR, "fedrelay.peer.strategies.fedseq", aggregator="maecho"),
    Strategy("ofasd", "OFASD: task vectors combined with per-block coefficients distilled from the ensemble "
             "(Koshibuchi et al., Alg. 1)", STAR, "fedrelay.peer.strategies.fedseq", aggregator="ofasd"),
)}

AGGREGATORS: dict[str, Aggregator] = {a.name: a for a in (
    Aggregator("mean", "one-shot FedAvg: the mean of the uploads, sample-weighted or uniform",
               "fedrelay.peer.aggregators.mean"),
    Aggregator("fedelmy-pfl", "the uniform mean of the sites' pool averages (FedELMY supplementary Alg. 2)",
               "fedrelay.peer.aggregators.fedelmy_pfl"),
    Aggregator("maecho", "MA-Echo Alg. 1: echo iterations in the null spaces of the sites' inputs",
               "fedrelay.peer.aggregators.maecho"),
    Aggregator("ofasd", "OFASD Alg. 1: per-(site, block) coefficients of unit task vectors, learned by KL "
               "to the ensemble on the aggregating site's own data", "fedrelay.peer.aggregators.ofasd"),
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


def load_aggregator(name: str):
    """Import aggregator ``name``'s module (peer side; imports torch)."""
    return importlib.import_module(aggregator(name).module)
