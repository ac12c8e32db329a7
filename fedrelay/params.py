"""A run's training parameters: the one mapping between the wire (``TrainingParams``), the ledger
(a dict), the CLI's flags and the peer's ``TrainConfig``, and the one place they are checked.

Every field is checked here, once and completely, before anything is written: by the CLI
(a clear message before the call), by the coordinator (``INVALID_ARGUMENT`` before a run is
recorded) and by the peer (an assignment it could not run is refused).

Three kinds of parameter: the training fields every strategy reads (:data:`FIELDS`, the peer's
``TrainConfig``), the run's initial model and differential privacy (:data:`RUN_OPTIONS`,
``fedrelay.privacy.OPTIONS``), and the **method options** the strategies and aggregators declare
in their registry entries (``fedrelay.registry.Option``), each checked for the strategies that
read it. On the wire a method option travels in its own ``TrainingParams`` field where it has one
(the options from before ``method_options``: ``weighting`` .. ``upload_timeout``, so that older
clients and the ledger's records keep their form), otherwise as text in
``TrainingParams.method_options`` (``Option.encode`` / ``Option.decode``): a new method's options
need no change to the proto.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fedrelay import privacy, registry
from fedrelay.names import MAX_METHOD_OPTIONS

SELECTIONS = ("best-val", "last-epoch")
INITS = ("shared", "per-site", "file")
MAX_EPOCHS = 100_000   # per field; more is a typo, not a plan
MAX_BATCH = 1 << 20


@dataclass(frozen=True)
class Field:
    name: str      # TrainingParams / TrainConfig field
    flag: str      # the start-chain option
    kind: type     # int | float | str
    minimum: float | None = None   # the smallest allowed (inclusive)
    positive: bool = False         # floats: > 0 instead of >= 0
    choices: tuple[str, ...] = ()  # strs: the allowed values
    default: object = None         # run options: the value of an unset (zero / empty) field
    maximum: float | None = None   # the largest allowed (inclusive)

    def check(self, value) -> None:
        """Raise ``ValueError`` naming :attr:`flag` for a value of the wrong type or range."""
        registry.check_value(self.flag, self.kind, value, minimum=self.minimum, maximum=self.maximum,
                             positive=self.positive, choices=self.choices)


FIELDS = (
    Field("strategy", "--strategy", str),
    Field("models_per_site", "--models-per-site", int, 1, maximum=MAX_EPOCHS),
    Field("local_epochs", "--local-epochs", int, 1, maximum=MAX_EPOCHS),
    Field("warmup_epochs", "--warmup-epochs", int, 0, maximum=MAX_EPOCHS),
    Field("alpha", "--alpha", float, 0.0),
    Field("beta", "--beta", float, 0.0),
    Field("lr", "--lr", float, 0.0, positive=True),
    Field("batch_size", "--batch-size", int, 1, maximum=MAX_BATCH),
    Field("weight_decay", "--weight-decay", float, 0.0),
    Field("selection", "--selection", str, choices=SELECTIONS),
)
# The initial model, read by every strategy: on the wire an empty value means the default (the
# strategy's registry.Strategy.init; proto3 cannot tell unset from empty).
RUN_OPTIONS = (
    Field("init", "--init", str, choices=INITS, default=""),
    Field("init_sha256", "--init-weights", str, default=""),
)
TRAIN_NAMES = tuple(f.name for f in FIELDS)   # what TrainConfig holds
# Every option: the run's, then every registered method's (fedrelay.registry), then DP's. Kept
# in step with the registry (registry.on_change) by _declared().
OPTIONS: tuple = ()
OPTION_NAMES: tuple[str, ...] = ()
NAMES: tuple[str, ...] = ()


def _declared() -> None:
    global OPTIONS, OPTION_NAMES, NAMES
    options = RUN_OPTIONS + registry.all_options() + privacy.OPTIONS
    names = [f.name for f in options]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(TRAIN_NAMES)))
    if clash:
        raise ValueError(f"option names taken twice: {', '.join(clash)}")
    OPTIONS, OPTION_NAMES = options, tuple(names)
    NAMES = TRAIN_NAMES + OPTION_NAMES


_declared()
registry.on_change(_declared)


def option(name: str):
    """The declaration of option ``name`` (a :class:`Field` or ``registry.Option``). Raises
    ``KeyError``."""
    for f in FIELDS + OPTIONS:
        if f.name == name:
            return f
    raise KeyError(f"{name!r} is not a run parameter")


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of the string field ``name`` (e.g. ``"weighting"``): the CLI's choices."""
    try:
        found = option(name).choices
    except KeyError:
        found = ()
    if not found:
        raise KeyError(f"{name!r} is not a field with choices")
    return found


@functools.lru_cache(maxsize=None)
def _pb_fields() -> dict:
    """``TrainingParams``' fields by name (its descriptor's), ``method_options`` left out."""
    from fedrelay.v1 import common_pb2

    return {f.name: f for f in common_pb2.TrainingParams.DESCRIPTOR.fields if f.name != "method_options"}


def has_field(name: str) -> bool:
    """Whether ``name`` travels in a ``TrainingParams`` field of its own (else in
    ``method_options``)."""
    return name in _pb_fields()


def to_dict(p) -> dict:
    """``TrainingParams`` (or anything with its attributes) as a plain dict in field order, the
    ``method_options`` entries after the fields, decoded by their declared type (an undeclared
    one, or text that does not parse, as is: :func:`check` refuses it)."""
    out = {name: getattr(p, name) for name in NAMES if hasattr(p, name) and has_field(name)}
    for key in sorted(getattr(p, "method_options", None) or {}):
        text = p.method_options[key]
        try:
            out[key] = option(key).decode(text)
        except (KeyError, AttributeError):  # not declared, or a Field (its own field on the wire)
            out[key] = text
    return out


def to_pb(d: dict):
    """``TrainingParams`` of the dict ``d``: the fields it names, and its method options without a
    field of their own in ``method_options`` (as text)."""
    from fedrelay.v1 import common_pb2

    p = common_pb2.TrainingParams(**{k: d[k] for k in NAMES if k in d and has_field(k)})
    for k in OPTION_NAMES:
        if k in d and not has_field(k):
            p.method_options[k] = option(k).encode(d[k])
    return p


def train_config(d: dict) -> dict:
    """The fields of ``d`` that ``fedrelay.peer.training.TrainConfig`` holds: the training fields
    and the run's recipe (``registry.RECIPE_OPTIONS``; one not given, or empty, at its default)."""
    return {**{k: d[k] for k in TRAIN_NAMES}, **{o.name: d.get(o.name) or o.default for o in registry.RECIPE_OPTIONS}}


def read_by(strategy: str) -> tuple:
    """The options a run of ``strategy`` reads: the run's, DP's and the strategy's declared ones
    (``registry.options_of``: its plan's, its own, its aggregator's)."""
    return RUN_OPTIONS + registry.options_of(strategy) + privacy.OPTIONS


def options(d: dict) -> dict:
    """The options a run of ``d["strategy"]`` reads (:func:`read_by`), typed: what the peer hands
    the method (``Context.options``, ``site_extras``). An option not given takes its declared
    default, and so does a zero or empty one that has a field of its own (proto3 cannot tell
    it from unset); ``init`` is resolved to the strategy's default (``registry.Strategy.init``)
    when empty."""
    out = {}
    for f in read_by(d["strategy"]):
        value = d.get(f.name)
        out[f.name] = f.default if value is None or (has_field(f.name) and not value) else value
    if not out["init"]:
        out["init"] = registry.strategy(d["strategy"]).init
    return out


@functools.lru_cache(maxsize=None)
def _wire_limits() -> dict[str, tuple[type, int, int]]:
    """Field name -> (Python type, smallest, largest) for the integer fields of ``TrainingParams``,
    read from the protobuf descriptor (uint32: 0 .. 2**32 - 1), so the check follows the wire."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    bits = {FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_INT32: (-2**31, 2**31 - 1),
            FD.TYPE_INT64: (-2**63, 2**63 - 1)}
    return {name: bits[f.type] for name, f in _pb_fields().items() if f.type in bits}


def check_wire(d: dict) -> None:
    """Raise ``ValueError`` naming the option (by its flag) of any field of ``d`` that its wire
    type cannot hold: a negative or too large integer for a uint32, a non-number for a double, a
    non-string for a string (a method option in ``method_options``: a value of another type than
    declared). Every field present is checked, whatever the strategy, so that :func:`to_pb`
    never fails."""
    limits = _wire_limits()
    for f in FIELDS + OPTIONS:
        if f.name not in d:
            continue
        value = d[f.name]
        if f.kind is str and not isinstance(value, str):
            raise ValueError(f"{f.flag} must be a string, got {value!r}")
        if f.kind is not str and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{f.flag} must be a number, got {value!r}")
        if f.kind is int and not isinstance(value, int):
            raise ValueError(f"{f.flag} must be an integer, got {value!r}")
        if f.name in limits:
            lo, hi = limits[f.name]
            if not lo <= value <= hi:
                raise ValueError(f"{f.flag} must be between {lo} and {hi} (an unsigned 32-bit integer), got {value}")
    if sum(1 for k in d if k in OPTION_NAMES and not has_field(k)) > MAX_METHOD_OPTIONS:
        raise ValueError(f"at most {MAX_METHOD_OPTIONS} method options")


MAX_SEED = 2**64 - 1  # StartChainRequest.seed is a uint64


def check_seed(seed: int) -> None:
    """Raise ``ValueError`` unless 0 <= seed <= 2**64 - 1 (the wire's uint64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer between 0 and {MAX_SEED}, got {seed!r}")


def check(d: dict, strict: bool = False) -> None:
    """Raise ``ValueError`` naming the first bad field by its CLI flag: an unknown strategy or
    selection, a non-integer, a value out of range, a float that is not finite (nan, inf), an
    option no registered method declares, or an initial model the strategy cannot use (an
    aggregator that needs one initial model, ``registry.Aggregator.one_initial_model``, refuses
    ``--init per-site``; ``--init file`` needs ``--init-weights`` as 64 hex digits). Method
    options are checked as declared (``registry.Option``) for the strategies that read them;
    unset ones (missing, or zero / empty in a field of their own) take their defaults, unless
    ``strict`` (the CLI: what the operator typed is checked as typed, so ``--maecho-tau 0`` is
    refused). The differential-privacy options are checked by :func:`fedrelay.privacy.check`
    (DP on for a strategy it does not cover, or with ``--selection best-val``, is refused).
    Every field present, used or not, must also fit its wire type (:func:`check_wire`)."""
    try:
        strategy = registry.strategy(d["strategy"])
    except ValueError as exc:
        raise ValueError(f"--strategy: {exc}") from None
    for f in FIELDS:
        f.check(d[f.name])
    if not any(f.name in d for f in OPTIONS):
        check_wire(d)
        return  # a TrainConfig: training fields only
    unknown = sorted(set(d) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown method option {unknown[0][:64]!r}: no registered strategy or aggregator declares "
                         f"it (the options of {strategy.name}: "
                         f"{', '.join(o.flag for o in registry.options_of(strategy.name)) or 'none'})")
    opts = options(d)
    if strict:
        opts.update({f.name: d[f.name] for f in OPTIONS if f.name in d and f.name != "init" and f.kind is not str})
    for f in read_by(strategy.name):
        f.check(opts[f.name])
    sha = opts["init_sha256"]
    if opts["init"] == "file":
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"--init-weights must be the weights file's SHA-256 (64 lowercase hex digits), got {sha!r}")
    elif sha:
        raise ValueError("--init-weights names a weights file: use it with --init file")
    privacy.check({**opts, "strategy": strategy.name, "selection": d["selection"]})
    why = registry.aggregator(strategy.aggregator).one_initial_model if strategy.aggregator else ""
    if why and opts["init"] == "per-site":
        raise ValueError(f"--init per-site: {strategy.name} {why}; use --init shared or --init file")
    check_wire(d)  # the fields the strategy does not read must still fit the wire


MAX_ROUNDS = 100  # T; with at most 1,024 sites, hop numbers stay below fedrelay.names.MAX_HOP


def check_rounds(rounds: int) -> None:
    """Raise ``ValueError`` unless 1 <= rounds <= MAX_ROUNDS."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds must be between 1 and {MAX_ROUNDS}, got {rounds!r}")
