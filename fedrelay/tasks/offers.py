"""What a site registers for each task it has installed: a :class:`Offer` (the code's name,
version and digest, the task's models and train-time augmentations, and the task's
:class:`fedrelay.DataSummary` of the site's folder, or why the task cannot read it). The daemon
makes them at start, the coordinator keeps them in its ledger and plans runs from them. No torch,
no task code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from fedrelay.task import DataSummary, canonical_json

__all__ = ["Offer"]


@dataclass(frozen=True)
class Offer:
    """One task offered by a site.

    Attributes:
        name, version, sha256: the task (``fedrelay.tasks.Installed``).
        models: the task's model names, the first the default.
        summary: what the task reads in the site's folder (None when it cannot: see ``error``).
        error: why the task cannot be used at this site ("" when it can).
        positive_class: for two-class tasks, the class the task calls positive ("" = default).
        augmentations: the train-time augmentations the task offers (``fedrelay.Task.augmentations``,
            the names of ``coordinator start-chain --augment``); empty: none, or a site too old to
            say (an offer registered before the field existed).
    """

    name: str
    version: str
    sha256: str
    models: tuple[str, ...] = ()
    summary: DataSummary | None = None
    error: str = ""
    positive_class: str = ""
    augmentations: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return self.summary is not None and not self.error

    def to_pb(self):
        from fedrelay.v1 import coordinator_pb2 as cpb

        m = cpb.TaskOffer(name=self.name, version=self.version, sha256=self.sha256, models=list(self.models),
                          error=self.error, positive_class=self.positive_class,
                          augmentations=list(self.augmentations))
        if self.summary is not None:
            m.classes.extend(cpb.ClassCount(name=k, train=a, test=b) for k, (a, b) in sorted(self.summary.classes.items()))
            m.input_json = canonical_json(self.summary.input)
            m.stats_json = canonical_json(self.summary.stats) if self.summary.stats else ""
        return m

    @classmethod
    def from_pb(cls, m) -> "Offer":
        """Raises ``ValueError`` for JSON fields that do not parse."""
        summary = None
        if not m.error:
            try:
                summary = DataSummary(classes={c.name: (int(c.train), int(c.test)) for c in m.classes},
                                      input=json.loads(m.input_json or "{}"),
                                      stats=json.loads(m.stats_json) if m.stats_json else {})
            except ValueError as exc:
                raise ValueError(f"task {m.name!r}: malformed input or stats description: {exc}") from None
        return cls(name=m.name, version=m.version, sha256=m.sha256, models=tuple(m.models), summary=summary,
                   error=m.error, positive_class=m.positive_class, augmentations=tuple(m.augmentations))

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "sha256": self.sha256, "models": list(self.models),
                "summary": self.summary.to_dict() if self.summary is not None else None, "error": self.error,
                "positive_class": self.positive_class, "augmentations": list(self.augmentations)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Offer":
        summary = d.get("summary")
        return cls(name=d["name"], version=d.get("version", ""), sha256=d.get("sha256", ""),
                   models=tuple(d.get("models") or ()),
                   summary=DataSummary.from_dict(summary) if summary is not None else None,
                   error=d.get("error", ""), positive_class=d.get("positive_class") or "",
                   augmentations=tuple(d.get("augmentations") or ()))
