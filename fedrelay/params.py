"""A run's training parameters: the one mapping between the wire (``TrainingParams``), the ledger
(a dict), the CLI's flags and the peer's ``TrainConfig``, and the one place they are checked.

Every field is checked here, once and completely, before anything is written: by the CLI
(a clear message before the call), by the coordinator (``INVALID_ARGUMENT`` before a run is
recorded) and by the peer (an assignment it could not run is refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedrelay import registry

SELECTIONS = ("best-val", "last-epoch")


@dataclass(frozen=True)
class Field:
    name: str      # TrainingParams / TrainConfig field
    flag: str      # the start-chain option
    kind: type     # int | float | str
    minimum: float | None = None   # ints: smallest allowed; floats: see `positive`
    positive: bool = False         # floats: > 0 instead of >= 0


FIELDS = (
    Field("strategy", "--strategy", str),
    Field("models_per_site", "--models-per-site", int, 1),
    Field("local_epochs", "--local-epochs", int, 1),
    Field("warmup_epochs", "--warmup-epochs", int, 0),
    Field("alpha", "--alpha", float, 0.0),
    Field("beta", "--beta", float, 0.0),
    Field("lr", "--lr", float, 0.0, positive=True),
    Field("batch_size", "--batch-size", int, 1),
    Field("weight_decay", "--weight-decay", float, 0.0),
    Field("selection", "--selection", str),
)
NAMES = tuple(f.name for f in FIELDS)
MAX_EPOCHS = 100_000   # per field; more is a typo, not a plan
MAX_BATCH = 1 << 20


def to_dict(p) -> dict:
    """``TrainingParams`` (or anything with its attributes) as a plain dict in field order."""
    return {name: getattr(p, name) for name in NAMES}


def to_pb(d: dict):
    from fedrelay.v1 import common_pb2

    return common_pb2.TrainingParams(**{k: d[k] for k in NAMES if k in d})


def check(d: dict) -> None:
    """Raise ``ValueError`` naming the first bad field by its CLI flag: an unknown strategy or
    selection, a non-integer, a value out of range, or a float that is not finite (nan, inf)."""
    try:
        registry.strategy(d["strategy"])
    except ValueError as exc:
        raise ValueError(f"--strategy: {exc}") from None
    if d["selection"] not in SELECTIONS:
        raise ValueError(f"--selection must be one of {', '.join(SELECTIONS)}, got {d['selection']!r}")
    for f in FIELDS:
        value = d[f.name]
        if f.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.flag} must be an integer, got {value!r}")
            top = MAX_BATCH if f.name == "batch_size" else MAX_EPOCHS
            if not f.minimum <= value <= top:
                raise ValueError(f"{f.flag} must be between {f.minimum:g} and {top}, got {value}")
        elif f.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.flag} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.flag} must be a finite number, got {value!r}")
            if f.positive and value <= 0:
                raise ValueError(f"{f.flag} must be > 0, got {value!r}")
            if value < f.minimum:
                raise ValueError(f"{f.flag} must be >= {f.minimum:g}, got {value!r}")


MAX_ROUNDS = 100  # T; with at most 1,024 sites, hop numbers stay below fedrelay.names.MAX_HOP


def check_rounds(rounds: int) -> None:
    """Raise ``ValueError`` unless 1 <= rounds <= MAX_ROUNDS."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds must be between 1 and {MAX_ROUNDS}, got {rounds!r}")
