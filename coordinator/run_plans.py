"""The runs' recorded plans as the coordinator reads them: every version of a run's plan (the
ledger's ``plans`` rows) parsed once, the current plan, the planned transfer a report names,
and the sites routed around."""

from __future__ import annotations

from fedrelay import purpose as purposes
from fedrelay.coordinator.plan import Plan, Transfer


class RunPlans:
    """The plans of the runs in ``ledger`` (a ``Ledger``), parsed once per (run, version)."""

    def __init__(self, ledger):
        self.ledger = ledger
        self._cache: dict[tuple[str, int], tuple[Plan, dict]] = {}  # (run, version) -> plan, transfer index

    def parsed(self, run_id: str, version: dict) -> tuple[Plan, dict]:
        """A plan version (a row of ``Ledger.plans``) parsed once per (run, version), with its
        transfers indexed by (purpose, index, sender, receiver)."""
        key = (run_id, version["version"])
        hit = self._cache.get(key)
        if hit is None:
            plan = Plan.from_json(version["plan"])
            hit = self._cache[key] = (plan, {(t.purpose, t.index, t.sender, t.receiver): t
                                             for t in plan.transfers})
        return hit

    def current(self, run_id: str) -> tuple[int, Plan]:
        """(version, plan) of the run's current plan."""
        latest = self.ledger.plans(run_id)[-1]
        return latest["version"], self.parsed(run_id, latest)[0]

    def planned(self, run_id: str, purpose: str, index: int, sender: str, receiver: str) -> Transfer | None:
        """The transfer of any version of the run's plan with these fields (``purpose``: the
        ledger's word), else None. A transfer made before a reroute dropped it is still a planned
        one (its report may come after the reroute). A dict lookup per version, whatever the
        number of sites."""
        for version in reversed(self.ledger.plans(run_id)):
            t = self.parsed(run_id, version)[1].get((purposes.from_ledger(purpose), index, sender, receiver))
            if t is not None:
                return t
        return None

    def skipped(self, run_id: str) -> set[str]:
        """The sites of the run routed around."""
        return {k["site"] for k in self.ledger.skips(run_id)}

    def live_order(self, run: dict) -> list[dict]:
        """The run's sites in chain order, without those routed around."""
        skipped = self.skipped(run["run_id"])
        return [c for c in run["chain"] if c["name"] not in skipped]
