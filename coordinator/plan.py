"""A run is a transfer plan: every model transfer of a run, decided before it starts.

Pure functions (no network, no ledger): the same order, rounds and skips always give the same
plan. Words (README "How a run flows"):

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

The expected bytes of a run come from its plan (``len(plan.hops)`` × M), not from a formula.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HOP, FINAL = "hop", "final"
PURPOSES = (HOP, FINAL)


class PlanError(ValueError):
    """The requested run cannot be planned; the message says why and what to do."""


@dataclass(frozen=True, order=True)
class Visit:
    index: int   # v: 0-based across rounds
    round: int   # 1-based
    site: str


@dataclass(frozen=True)
class Transfer:
    """One planned model transfer. ``purpose``: ``"hop"`` or ``"final"``; ``index``: the hop number
    (>= 1) or 0 for a final copy; ``round``: 1-based (a hop: its receiver's round)."""

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

        purpose = common_pb2.CHAIN_HOP if self.purpose == HOP else common_pb2.FINAL_MODEL
        return common_pb2.PlannedTransfer(purpose=purpose, index=self.index, round=self.round,
                                          sender=self.sender, receiver=self.receiver)

    @classmethod
    def from_pb(cls, t) -> "Transfer":
        from fedrelay.v1 import common_pb2

        if t.purpose not in (common_pb2.CHAIN_HOP, common_pb2.FINAL_MODEL):
            raise ValueError(f"planned transfer with unknown purpose {t.purpose}")
        return cls(HOP if t.purpose == common_pb2.CHAIN_HOP else FINAL, t.index, t.round, t.sender, t.receiver)


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

    @property
    def final_site(self) -> str:
        """The site of the last visit: it produces the final model and copies it to the others."""
        return self.visits[-1].site

    @property
    def hops(self) -> list[Transfer]:
        return [t for t in self.transfers if t.purpose == HOP]

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
        return {"visits": [[v.index, v.round, v.site] for v in self.visits],
                "transfers": [[t.purpose, t.index, t.round, t.sender, t.receiver] for t in self.transfers]}

    @classmethod
    def from_json(cls, doc: dict) -> "Plan":
        return cls(tuple(Visit(*v) for v in doc["visits"]), tuple(Transfer(*t) for t in doc["transfers"]))


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
