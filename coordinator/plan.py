"""A run is a transfer plan: every model transfer of a run, decided before it starts.

Pure functions (no network, no ledger): the same order, rounds and skips always give the same
plan. Words (docs/explanation/run-flow.md):

- a **visit** is one site's turn in the chain: visit ``v`` (0-based) is round ``v // N + 1`` at
  ``order[v % N]``; a run of T rounds over N sites has T·N visits (supplementary Alg. 1: the last
  site of round r hands on to the first site of round r+1).
- a **transfer** (:class:`Transfer`) has a purpose, an index, a round, a sender and a receiver.
  A chain **hop** has index ``h >= 1`` and ends at visit ``h``; hop numbers never change, so a
  reroute may give a hop another sender but never another receiver. A **final** copy (index 0)
  carries the final model from the site of the chain's last visit to every other site, for
  evaluation. A plan of T rounds over N sites has T·N−1 hops (one-shot: T = 1, N−1 hops).
- a site routed around (it stayed down) loses all its later visits; two visits of the same site
  that become adjacent collapse into one (a site never sends to itself).
- a **star** plan (the parallel one-shot methods: one-shot FedAvg, FedELMY-PFL, MA-Echo, OFASD)
  has one visit per site, all in round 1 and in parallel; every site but the **aggregator**
  sends one **upload** (index 1 + its position in the order, so indices never change) to the
  aggregator, which combines the uploads with its own model and copies the final model to every
  other site. N−1 uploads and N−1 final copies; a site routed around before its upload arrived
  loses both.

The expected bytes of a run come from its plan (``len(plan.hops)`` × M), not from a formula.

Before the transfers, :func:`choose_sites` decides which sites, in which order, with which class
index and model (the run's :class:`fedrelay.ModelSpec`), from the sites' registrations (their task
offers). Every refusal here is a :class:`PlanError`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fedrelay import tasks as task_registry
from fedrelay.task import ModelSpec, canonical_json
from fedrelay.tasks.offers import Offer

from fedrelay.purpose import FINAL, HOP, UPLOAD, from_wire as plan_purpose, to_wire as wire_purpose  # the one vocabulary


class PlanError(ValueError):
    """The requested run cannot be planned; the message says why and what to do."""


@dataclass(frozen=True, order=True)
class Visit:
    index: int   # v: 0-based across rounds
    round: int   # 1-based
    site: str


@dataclass(frozen=True)
class Transfer:
    """One planned model transfer. ``purpose``: ``"hop"``, ``"final"`` or ``"upload"``; ``index``:
    the hop number (>= 1), 0 for a final copy, 1 + the sender's position for an upload;
    ``round``: 1-based (a hop: its receiver's round)."""

    purpose: str
    index: int
    round: int
    sender: str
    receiver: str

    @property
    def key(self) -> tuple[str, int, str]:
        """What identifies a transfer across route versions: (purpose, index, receiver)."""
        return (self.purpose, self.index, self.receiver)

    def to_pb(self):
        from fedrelay.v1 import common_pb2

        return common_pb2.PlannedTransfer(purpose=wire_purpose(self.purpose), index=self.index, round=self.round,
                                          sender=self.sender, receiver=self.receiver)

    @classmethod
    def from_pb(cls, t) -> "Transfer":
        return cls(plan_purpose(t.purpose), t.index, t.round, t.sender, t.receiver)


def chain_visits(order: Sequence[str], rounds: int) -> list[Visit]:
    """Every visit of a chain over ``order`` for ``rounds`` rounds (T·N of them).

    Raises ``PlanError``: fewer than 2 sites or ``rounds < 1``."""
    if len(order) < 2:
        raise PlanError(f"a chain needs at least 2 sites, got {len(order)}")
    if rounds < 1:
        raise PlanError(f"--rounds must be >= 1, got {rounds}")
    n = len(order)
    return [Visit(v, v // n + 1, order[v % n]) for v in range(rounds * n)]


def _collapse(visits: Iterable[Visit]) -> list[Visit]:
    out: list[Visit] = []
    for v in visits:
        if not out or out[-1].site != v.site:
            out.append(v)
    return out


def live_visits(order: Sequence[str], rounds: int, skipped: Iterable[str] = ()) -> list[Visit]:
    """The visits left once the ``skipped`` sites are routed around (adjacent visits of one site
    collapsed into the first)."""
    skipped = set(skipped)
    return _collapse(v for v in chain_visits(order, rounds) if v.site not in skipped)


def transfers_along(visits: Sequence[Visit], recipients: Sequence[str]) -> list[Transfer]:
    """The hops that carry the model along ``visits``, then the final copies from the last
    visit's site to every other site of ``recipients`` (in that order)."""
    hops = [Transfer(HOP, b.index, b.round, a.site, b.site) for a, b in zip(visits, visits[1:])]
    last = visits[-1]
    return hops + [Transfer(FINAL, 0, last.round, last.site, s) for s in recipients if s != last.site]


@dataclass(frozen=True)
class SitePart:
    """What one site needs of a plan: the transfers it sends or receives, and the rounds in which
    it trains (one visit each, ascending)."""

    transfers: tuple[Transfer, ...]
    visits: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The visits the model passes through, in order, and the transfers that carry it."""

    visits: tuple[Visit, ...]
    transfers: tuple[Transfer, ...]
    aggregator: str = ""   # a star plan's aggregating site; "" for a chain

    @property
    def final_site(self) -> str:
        """The site that produces the final model and copies it to the others: a chain's last
        visit, a star's aggregator."""
        return self.aggregator or self.visits[-1].site

    @property
    def hops(self) -> list[Transfer]:
        return [t for t in self.transfers if t.purpose == HOP]

    @property
    def uploads(self) -> list[Transfer]:
        return [t for t in self.transfers if t.purpose == UPLOAD]

    def part(self, site: str) -> SitePart:
        return SitePart(tuple(t for t in self.transfers if site in (t.sender, t.receiver)),
                        tuple(v.round for v in self.visits if v.site == site))

    def part_pb(self, site: str, address: dict[str, str]) -> dict:
        """``site``'s part as the fields of an ``Assignment`` / ``RerouteRequest``: ``transfers``
        (PlannedTransfer), ``peers`` (SiteRef of every site they name, at ``address[name]``) and
        ``visits`` (the rounds it trains in)."""
        from fedrelay.v1 import common_pb2

        part = self.part(site)
        names = sorted({n for t in part.transfers for n in (t.sender, t.receiver)} - {site})
        return {"transfers": [t.to_pb() for t in part.transfers],
                "peers": [common_pb2.SiteRef(name=n, address=address[n]) for n in names],
                "visits": list(part.visits)}

    def to_json(self) -> dict:
        doc = {"visits": [[v.index, v.round, v.site] for v in self.visits],
               "transfers": [[t.purpose, t.index, t.round, t.sender, t.receiver] for t in self.transfers]}
        if self.aggregator:
            doc["aggregator"] = self.aggregator
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> "Plan":
        return cls(tuple(Visit(*v) for v in doc["visits"]), tuple(Transfer(*t) for t in doc["transfers"]),
                   doc.get("aggregator", ""))


def _plan(visits: Sequence[Visit], recipients: Sequence[str]) -> Plan:
    return Plan(tuple(visits), tuple(transfers_along(visits, recipients)))


def chain_plan(order: Sequence[str], rounds: int = 1) -> Plan:
    """The plan of a sequential chain (FedELMY Alg. 1; T > 1: supplementary Alg. 1, few-shot
    cycles): T·N−1 hops, then N−1 final copies. Raises ``PlanError``."""
    return _plan(chain_visits(order, rounds), list(order))


def replan(order: Sequence[str], rounds: int, current: Plan, skipped: Iterable[str],
           resume: Visit | None) -> Plan:
    """The plan after routing around the ``skipped`` sites.

    ``resume`` is the visit whose model the chain carries on from (the latest live visit that
    holds one); the visits up to it, and the hops between them, stay as they are in
    ``current``. ``None``: no live site holds a model; the first live visit starts afresh (a
    warm-up). The final copies go to every site not skipped.
    """
    skipped = set(skipped)
    live = live_visits(order, rounds, skipped)
    recipients = [s for s in order if s not in skipped]
    if resume is None:
        return _plan(live, recipients)
    past = [v for v in current.visits if v.index < resume.index]
    return _plan(past + _collapse([resume, *(v for v in live if v.index > resume.index)]), recipients)


def pick_aggregator(order: Sequence[str], seed: int) -> str:
    """The aggregating site a star plan uses when the operator names none: fixed by the run's
    seed (SHA-256 of ``"aggregator:<seed>"`` modulo N over the sorted site names), so the same
    seed over the same sites always picks the same site."""
    import hashlib

    names = sorted(order)
    digest = hashlib.sha256(f"aggregator:{seed}".encode()).digest()
    return names[int.from_bytes(digest[:8], "big") % len(names)]


def star_plan(order: Sequence[str], aggregator: str, skipped: Iterable[str] = (),
              received: Iterable[str] = ()) -> Plan:
    """The plan of a parallel one-shot method: every site trains in round 1; every site but
    ``aggregator`` uploads to it (index 1 + its position in ``order``); the aggregator copies
    the final model to every other site (FedELMY supplementary Alg. 2 with a central
    aggregating site, which the supplementary calls equivalent to the decentralised version).

    ``skipped``: sites routed around; they keep no visit and get no final copy, and their upload
    stays in the plan only when it already arrived (``received``: senders whose upload the
    aggregator holds). Raises ``PlanError``: fewer than 2 sites, an aggregator not in ``order``
    or skipped.
    """
    if len(order) < 2:
        raise PlanError(f"a star plan needs at least 2 sites, got {len(order)}")
    if len(set(order)) != len(order):
        raise PlanError("a site is named twice in the order")
    if aggregator not in order:
        raise PlanError(f"--aggregator {aggregator!r} is not one of the run's sites ({', '.join(order)})")
    skipped, received = set(skipped), set(received)
    if aggregator in skipped:
        raise PlanError(f"the aggregating site {aggregator} was routed around")
    live = [s for s in order if s not in skipped]
    visits = [Visit(i, 1, s) for i, s in enumerate(order) if s in live and s != aggregator]
    visits.append(Visit(order.index(aggregator), 1, aggregator))
    uploads = [Transfer(UPLOAD, i + 1, 1, s, aggregator) for i, s in enumerate(order)
               if s != aggregator and (s not in skipped or s in received)]
    finals = [Transfer(FINAL, 0, 1, aggregator, s) for s in live if s != aggregator]
    return Plan(tuple(visits), tuple(uploads + finals), aggregator)


# --------------------------------------------------------------------------- choosing the sites

ORDERS = ("random", "given")


@dataclass(frozen=True)
class PeerInfo:
    name: str
    address: str
    offers: dict[str, Offer]             # task name -> what the site offers for it
    device: str = "cpu"


@dataclass
class SiteChoice:
    order: list[PeerInfo]
    class_index: list[str]
    model: ModelSpec
    warnings: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.order]


def choose_sites(peers: list[PeerInfo], *, names: list[str] | None = None, order: str = "random",
               seed: int = 0, task: str = "", model: str = "", task_sha256: str = "",
               augment: str = "none") -> SiteChoice:
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
    - augment: the run's ``--augment`` ("" or ``"none"``: none), a train-time augmentation every
      site's copy of the task must offer (``Offer.augmentations``), so that a run the sites would
      refuse at their first training is refused here, before anything is written.

    Raises ``PlanError``: fewer than 2 sites, unknown or repeated names, unknown order, a task a
    site does not offer or cannot read its data with, differing digests, input descriptions or
    statistics, an unknown model, an augmentation a site's task does not offer, a site without
    training samples.
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
    _check_augment(offers, task, augment or "none")
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
    return SiteChoice(order=chosen, class_index=class_index, model=spec, warnings=warnings)


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


def _check_augment(offers: dict[str, Offer], task: str, augment: str) -> None:
    """Refuse ``--augment augment`` when a site's copy of ``task`` does not offer it; the message
    names the sites lacking it, what they offer, and what every site offers (the choices left)."""
    if augment == "none":
        return
    lacking = {n: o.augmentations for n, o in offers.items() if augment not in o.augmentations}
    if not lacking:
        return
    if len(set(lacking.values())) == 1:
        offered = ", ".join(next(iter(lacking.values()))) or "none"
        what = f"{'it offers' if len(lacking) == 1 else 'they offer'}: {offered}"
    else:
        what = "; ".join(f"{n} offers: {', '.join(a) or 'none'}" for n, a in lacking.items())
    everywhere = [a for a in next(iter(offers.values())).augmentations
                  if all(a in o.augmentations for o in offers.values())]
    raise PlanError(f"--augment {augment}: task {task!r} has no train-time augmentation {augment!r} at "
                    f"{', '.join(lacking)} ({what}); use --augment "
                    + " or --augment ".join(["none", *everywhere]))


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
