"""Which sites, in which order, with which class index and model: a run's sites and its model
spec, from the sites' registrations (their task offers).

Pure functions on the peers' registrations (no network, no ledger), so that the same seed and
the same sites always give the same plan.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from fedrelay import tasks as task_registry
from fedrelay.task import ModelSpec, canonical_json
from fedrelay.tasks.offers import Offer

ORDERS = ("random", "given")


class PlanError(ValueError):
    """The requested run cannot be planned; the message says why and what to do."""


@dataclass(frozen=True)
class PeerInfo:
    name: str
    address: str
    offers: dict[str, Offer]             # task name -> what the site offers for it
    device: str = "cpu"


@dataclass
class ChainPlan:
    order: list[PeerInfo]
    class_index: list[str]
    model: ModelSpec
    warnings: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.order]


def plan_chain(peers: list[PeerInfo], *, names: list[str] | None = None, order: str = "random",
               seed: int = 0, task: str = "", model: str = "", task_sha256: str = "") -> ChainPlan:
    """Plan a run's sites over ``names`` (default: every peer given) and its model.

    - order ``random``: the sorted names shuffled by ``random.Random(seed)`` (so the seed alone
      fixes the order, whatever order the peers registered in); ``given``: ``names`` as listed.
    - task: ``task`` ("" = ``image-folder``) must be offered by every chosen site and read its
      data. Its digest is ``task_sha256`` when given, else the one every site reports; every
      chosen site must report the same one (a site whose copy differs is named, with both
      digests). The sites' input descriptions must be equal; their statistics are summed.
    - class index: the sorted union of the sites' class names for the task; label i is
      ``class_index[i]`` at every site. A site may lack classes (label skew); a class held by
      one site only is reported in ``warnings`` (often a misspelt folder name).
    - model: ``model`` ("" = the task's first model), which every site's copy must know.

    Raises ``PlanError``: fewer than 2 sites, unknown or repeated names, unknown order, a task a
    site does not offer or cannot read its data with, differing digests, input descriptions or
    statistics, an unknown model, a site without training samples.
    """
    task = task or task_registry.DEFAULT
    if order not in ORDERS:
        raise PlanError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")
    by_name = {p.name: p for p in peers}
    if names:
        dup = [n for n, c in Counter(names).items() if c > 1]
        if dup:
            raise PlanError(f"site listed more than once: {', '.join(dup)}")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            known = ", ".join(sorted(by_name)) or "none"
            raise PlanError(f"not registered with the coordinator: {', '.join(unknown)} (registered: {known})")
        chosen = [by_name[n] for n in names]
    else:
        if order == "given":
            raise PlanError("--order given needs --peers a,b,... in the order wanted")
        chosen = [by_name[n] for n in sorted(by_name)]
    if len(chosen) < 2:
        raise PlanError(f"a chain needs at least 2 sites, got {len(chosen)}")
    if order == "random":
        chosen = sorted(chosen, key=lambda p: p.name)
        random.Random(seed).shuffle(chosen)
    offers = _task_offers(chosen, task)
    sha = _pinned_digest(offers, task, task_sha256)
    inputs = {n: canonical_json(o.summary.input) for n, o in offers.items()}
    if len(set(inputs.values())) > 1:
        detail = "; ".join(f"{n}: {v}" for n, v in inputs.items())
        raise PlanError(f"the sites' data differ in what task {task!r} feeds the model (its input description): "
                        f"{detail}")
    empty = [n for n, o in offers.items() if sum(a for a, _ in o.summary.classes.values()) == 0]
    if empty:
        raise PlanError(f"sites without training samples: {', '.join(empty)}")
    models = [o.models for o in offers.values()]
    model = model or (models[0][0] if models[0] else "")
    lacking = [n for n, o in offers.items() if model not in o.models]
    if lacking:
        raise PlanError(f"unknown model {model!r} for task {task!r} at {', '.join(lacking)}: choose one of "
                        f"{', '.join(models[0]) or 'none'}")
    holders: dict[str, list[str]] = {}
    for n, o in offers.items():
        for cls, (train, test) in o.summary.classes.items():
            if train + test > 0:
                holders.setdefault(cls, []).append(n)
    class_index = sorted(holders)
    if len(class_index) < 2:
        raise PlanError(f"the sites hold {len(class_index)} class(es) in all for task {task!r}: a classification "
                        "run needs at least 2")
    warnings = [
        f"class {cls!r} is held by one site only ({sites[0]}): check the folder name"
        for cls, sites in sorted(holders.items()) if len(sites) == 1
    ]
    description = dict(next(iter(offers.values())).summary.input)
    stats = _summed_stats(offers)
    if stats:
        description["stats"] = stats
    versions = Counter(o.version for o in offers.values())
    spec = ModelSpec(task=task, model=model, num_classes=len(class_index), input_json=canonical_json(description),
                     task_version=versions.most_common(1)[0][0], task_sha256=sha)
    return ChainPlan(order=chosen, class_index=class_index, model=spec, warnings=warnings)


def _task_offers(chosen: list[PeerInfo], task: str) -> dict[str, Offer]:
    missing = [p.name for p in chosen if task not in p.offers]
    if missing:
        offered = sorted({t for p in chosen for t, o in p.offers.items() if o.usable})
        raise PlanError(f"task {task!r} is not installed at {', '.join(missing)} (the sites offer: "
                        f"{', '.join(offered) or 'none'}); install it there, or leave those sites out with --peers")
    broken = [(p.name, p.offers[task].error) for p in chosen if not p.offers[task].usable]
    if broken:
        raise PlanError(f"task {task!r} cannot read the data of " + "; ".join(f"{n}: {e}" for n, e in broken))
    return {p.name: p.offers[task] for p in chosen}


def _pinned_digest(offers: dict[str, Offer], task: str, pinned: str) -> str:
    """The digest the run pins: ``pinned``, else the one every site reports."""
    digests = {n: o.sha256 for n, o in offers.items()}
    if pinned:
        differ = {n: d for n, d in digests.items() if d != pinned}
        if differ:
            raise PlanError(f"task {task!r}: the run pins code SHA-256 {pinned}, but " + "; ".join(
                f"{n} has {d}" for n, d in differ.items()) + ": install the agreed release of the task there")
        return pinned
    if len(set(digests.values())) > 1:
        groups: dict[str, list[str]] = {}
        for n, d in digests.items():
            groups.setdefault(d, []).append(n)
        raise PlanError(f"the sites hold different copies of task {task!r}: " + "; ".join(
            f"{', '.join(ns)} have SHA-256 {d}" for d, ns in groups.items())
            + "; install one release everywhere, or pin the agreed one with --task-sha256")
    return next(iter(digests.values()))


def _summed_stats(offers: dict[str, Offer]) -> dict[str, list[float]]:
    names = {n: set(o.summary.stats) for n, o in offers.items()}
    if len({frozenset(v) for v in names.values()}) > 1:
        raise PlanError("the sites report different statistics for the task: " + "; ".join(
            f"{n}: {sorted(v)}" for n, v in names.items()))
    total: dict[str, list[float]] = {}
    for n, o in offers.items():
        for key, values in o.summary.stats.items():
            if key in total and len(total[key]) != len(values):
                raise PlanError(f"statistic {key!r} has {len(values)} values at {n}, {len(total[key])} elsewhere")
            total[key] = [a + float(b) for a, b in zip(total[key], values)] if key in total else [float(b) for b in values]
    return total
