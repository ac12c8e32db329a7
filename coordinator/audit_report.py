"""The verdict of an audit: the :class:`Problem` s found, in ledger order, and the
:class:`Report` that sums up what was checked (``coordinator/audit.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Problem:
    """One thing that does not verify: ``where`` (the record, row or event, in words),
    ``message`` (what is wrong), ``order`` (its place in the ledger: problems are reported in
    chain order, the run's row first)."""

    order: float
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """The outcome of :func:`verify`: ``problems`` (in ledger order), what was checked
    (``events``, ``records`` by type, ``signers``, ``sealed``, ``after_seal``) and whether the
    run's records are signed (``signed``; False: a plaintext run)."""

    run_id: str
    status: str = ""
    signed: bool = True
    problems: list[Problem] = field(default_factory=list)
    events: int = 0
    records: dict[str, int] = field(default_factory=dict)
    signers: set[str] = field(default_factory=set)
    sealed: bool = False
    after_seal: int = 0
    head: str = ""

    @property
    def first(self) -> Problem | None:
        return min(self.problems, key=lambda p: p.order) if self.problems else None

    @property
    def verified(self) -> bool:
        """Every check passed and every record is signed."""
        return not self.problems and self.signed

    @property
    def verdict(self) -> str:
        return "failed" if self.problems else ("verified" if self.signed else "unsigned")

    def ordered(self) -> list[Problem]:
        return sorted(self.problems, key=lambda p: p.order)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "verdict": self.verdict, "verified": self.verified, "signed": self.signed,
                "status": self.status, "events": self.events, "records": dict(self.records),
                "signers": sorted(self.signers), "sealed": self.sealed, "events_after_seal": self.after_seal,
                "head": self.head,
                "first_problem": str(self.first) if self.first else None,
                "problems": [{"where": p.where, "message": p.message} for p in self.ordered()]}

    def summary(self) -> str:
        """What was checked, in one sentence."""
        words = {"HopReport": "transfer report", "ReceiptReport": "receipt", "FinalReport": "final report",
                 "FailureReport": "failure report", "EvaluateReply": "evaluation"}
        kinds = ", ".join(f"{self.records[t]} {words[t]}{'s' if self.records[t] != 1 else ''}"
                          for t in words if t in self.records) or "no records"
        seal = ("sealed by the coordinator" + (f", {self.after_seal} event(s) after the seal" if self.after_seal else "")
                if self.sealed else "not sealed (the run has not ended)")
        who = f" signed by {', '.join(sorted(self.signers))}" if self.signed and self.signers else ""
        return (f"{self.events} events in one hash chain (head {self.head[:16]}), {seal}; {kinds}{who}; every "
                "hops, receipts and evaluations row and the run's row match them")
