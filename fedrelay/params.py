"""A run's training parameters: the one mapping between the wire (``TrainingParams``), the ledger
(a dict), the CLI's flags and the peer's ``TrainConfig``, and the one place they are checked.

Every field is checked here, once and completely, before anything is written: by the CLI
(a clear message before the call), by the coordinator (``INVALID_ARGUMENT`` before a run is
recorded) and by the peer (an assignment it could not run is refused).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fedrelay import privacy, registry

SELECTIONS = ("best-val", "last-epoch")
INITS = ("shared", "per-site", "file")


@dataclass(frozen=True)
class Field:
    name: str      # TrainingParams / TrainConfig field
    flag: str      # the start-chain option
    kind: type     # int | float | str
    minimum: float | None = None   # ints: smallest allowed; floats: see `positive`
    positive: bool = False         # floats: > 0 instead of >= 0
    choices: tuple[str, ...] = ()  # strs: the allowed values
    used_by: tuple[str, ...] = ()  # method options: the strategies that read it (checked only for them)
    default: object = None         # method options: the value of an unset (zero / empty) field


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
    Field("selection", "--selection", str, choices=SELECTIONS),
)
# The initial model and the aggregators' options: on the wire a zero or empty value means the
# default (proto3 cannot tell unset from zero), so a run started by an older client still checks.
OPTIONS = (
    Field("init", "--init", str, choices=INITS, default=""),
    Field("init_sha256", "--init-weights", str, default=""),
    Field("weighting", "--weighting", str, choices=("samples", "uniform"), used_by=("fedavg",), default="samples"),
    Field("maecho_tau", "--maecho-tau", int, 1, used_by=("maecho",), default=100),
    Field("maecho_eta", "--maecho-eta", float, 0.0, positive=True, used_by=("maecho",), default=0.05),
    Field("maecho_alpha", "--maecho-alpha", str, choices=("uniform", "qp"), used_by=("maecho",), default="uniform"),
    Field("ofasd_mode", "--ofasd-mode", str, choices=("block", "client"), used_by=("ofasd",), default="block"),
    Field("ofasd_epochs", "--ofasd-epochs", int, 1, used_by=("ofasd",), default=2),
    Field("ofasd_lr", "--ofasd-lr", float, 0.0, positive=True, used_by=("ofasd",), default=0.01),
    Field("upload_timeout", "--upload-timeout", float, 0.0, positive=True,
          used_by=("fedavg", "fedelmy-pfl", "maecho", "ofasd"), default=3600.0),
    # Differential privacy at the site (fedrelay/privacy.py): off unless a noise multiplier or a
    # target epsilon is given; checked as a whole by privacy.check.
    Field("dp_noise_multiplier", "--dp-noise-multiplier", float, 0.0, used_by=privacy.STRATEGIES, default=0.0),
    Field("dp_epsilon", "--dp-epsilon", float, 0.0, used_by=privacy.STRATEGIES, default=0.0),
    Field("dp_max_grad_norm", "--dp-max-grad-norm", float, 0.0, positive=True, used_by=privacy.STRATEGIES,
          default=privacy.DEFAULTS["dp_max_grad_norm"]),
    Field("dp_delta", "--dp-delta", float, 0.0, positive=True, used_by=privacy.STRATEGIES,
          default=privacy.DEFAULTS["dp_delta"]),
)
TRAIN_NAMES = tuple(f.name for f in FIELDS)   # what TrainConfig holds
OPTION_NAMES = tuple(f.name for f in OPTIONS)
NAMES = TRAIN_NAMES + OPTION_NAMES
MAX_EPOCHS = 100_000   # per field; more is a typo, not a plan
MAX_BATCH = 1 << 20


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of the string field ``name`` (e.g. ``"weighting"``): the CLI's choices."""
    for f in FIELDS + OPTIONS:
        if f.name == name and f.choices:
            return f.choices
    raise KeyError(f"{name!r} is not a field with choices")


def to_dict(p) -> dict:
    """``TrainingParams`` (or anything with its attributes) as a plain dict in field order."""
    return {name: getattr(p, name) for name in NAMES if hasattr(p, name)}


def to_pb(d: dict):
    from fedrelay.v1 import common_pb2

    return common_pb2.TrainingParams(**{k: d[k] for k in NAMES if k in d})


def train_config(d: dict) -> dict:
    """The fields of ``d`` that ``fedrelay.peer.training.TrainConfig`` holds."""
    return {k: d[k] for k in TRAIN_NAMES}


def options(d: dict) -> dict:
    """The initial-model and aggregator options of ``d``, unset ones at their default, and
    ``init`` resolved to the strategy's default (``registry.Strategy.init``) when empty."""
    out = {f.name: d.get(f.name) or f.default for f in OPTIONS}
    if not out["init"]:
        out["init"] = registry.strategy(d["strategy"]).init
    return out


def _check_value(f: Field, value) -> None:
    if f.kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{f.flag} must be a string, got {value!r}")
        if f.choices and value not in f.choices:
            raise ValueError(f"{f.flag} must be one of {', '.join(f.choices)}, got {value!r}")
        return
    if f.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{f.flag} must be an integer, got {value!r}")
        top = MAX_BATCH if f.name == "batch_size" else MAX_EPOCHS
        if not f.minimum <= value <= top:
            raise ValueError(f"{f.flag} must be between {f.minimum:g} and {top}, got {value}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{f.flag} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{f.flag} must be a finite number, got {value!r}")
    if f.positive and value <= 0:
        raise ValueError(f"{f.flag} must be > 0, got {value!r}")
    if value < f.minimum:
        raise ValueError(f"{f.flag} must be >= {f.minimum:g}, got {value!r}")


@functools.lru_cache(maxsize=None)
def _wire_limits() -> dict[str, tuple[type, int, int]]:
    """Field name -> (Python type, smallest, largest) for the integer fields of ``TrainingParams``,
    read from the protobuf descriptor (uint32: 0 .. 2**32 - 1), so the check follows the wire."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    from fedrelay.v1 import common_pb2

    bits = {FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_INT32: (-2**31, 2**31 - 1),
            FD.TYPE_INT64: (-2**63, 2**63 - 1)}
    return {f.name: bits[f.type] for f in common_pb2.TrainingParams.DESCRIPTOR.fields if f.type in bits}


def check_wire(d: dict) -> None:
    """Raise ``ValueError`` naming the option (by its flag) of any field of ``d`` that its wire
    type cannot hold: a negative or too large integer for a uint32, a non-number for a double, a
    non-string for a string. Every field present is checked, whatever the strategy, so that
    :func:`to_pb` never fails."""
    limits = _wire_limits()
    for f in FIELDS + OPTIONS:
        if f.name not in d:
            continue
        value = d[f.name]
        if f.kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{f.flag} must be a string, got {value!r}")
        elif f.kind is int:
            lo, hi = limits[f.name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.flag} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"{f.flag} must be between {lo} and {hi} (an unsigned 32-bit integer), got {value}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{f.flag} must be a number, got {value!r}")


MAX_SEED = 2**64 - 1  # StartChainRequest.seed is a uint64


def check_seed(seed: int) -> None:
    """Raise ``ValueError`` unless 0 <= seed <= 2**64 - 1 (the wire's uint64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer between 0 and {MAX_SEED}, got {seed!r}")


def check(d: dict, strict: bool = False) -> None:
    """Raise ``ValueError`` naming the first bad field by its CLI flag: an unknown strategy or
    selection, a non-integer, a value out of range, a float that is not finite (nan, inf), or
    an initial model the strategy cannot use (OFASD needs one shared initial model; ``--init
    file`` needs ``--init-weights`` as 64 hex digits). Method options are checked for the
    strategies that read them; unset ones (zero, empty) take their defaults, unless ``strict``
    (the CLI: what the operator typed is checked as typed, so ``--maecho-tau 0`` is refused).
    The differential-privacy options are checked by :func:`fedrelay.privacy.check` (DP on for a
    strategy it does not cover, or with ``--selection best-val``, is refused).
    Every field present, used or not, must also fit its wire type (:func:`check_wire`)."""
    try:
        strategy = registry.strategy(d["strategy"])
    except ValueError as exc:
        raise ValueError(f"--strategy: {exc}") from None
    for f in FIELDS:
        _check_value(f, d[f.name])
    if not any(f.name in d for f in OPTIONS):
        check_wire(d)
        return  # a TrainConfig: training fields only
    opts = options(d)
    if strict:
        opts.update({f.name: d[f.name] for f in OPTIONS if f.name in d and f.name != "init" and f.kind is not str})
    for f in OPTIONS:
        if not f.used_by or strategy.name in f.used_by:
            _check_value(f, opts[f.name])
    sha = opts["init_sha256"]
    if opts["init"] == "file":
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"--init-weights must be the weights file's SHA-256 (64 lowercase hex digits), got {sha!r}")
    elif sha:
        raise ValueError("--init-weights names a weights file: use it with --init file")
    privacy.check({**opts, "strategy": strategy.name, "selection": d["selection"]})
    if strategy.name == "ofasd" and opts["init"] == "per-site":
        raise ValueError("--init per-site: ofasd composes task vectors against one initial model; "
                         "use --init shared or --init file")
    check_wire(d)  # the fields the strategy does not read must still fit the wire


MAX_ROUNDS = 100  # T; with at most 1,024 sites, hop numbers stay below fedrelay.names.MAX_HOP


def check_rounds(rounds: int) -> None:
    """Raise ``ValueError`` unless 1 <= rounds <= MAX_ROUNDS."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds must be between 1 and {MAX_ROUNDS}, got {rounds!r}")
