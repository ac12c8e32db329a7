"""The one registry of what a run can do: site-side strategies and aggregators.

The CLI's choices, the coordinator's checks and the peer's dispatch all read this table, so a
strategy is added by writing one module and one entry here (docs/development.md, "Adding a strategy"). The
table itself imports nothing heavy (the coordinator and the CLI never import torch); the
module named by an entry is imported by the peer only when a site runs it (:func:`load`).

A **strategy** module (``fedrelay.peer.strategies.<name>``) provides::

    def train(m0, spec, train, val, cfg, seed, device, *, finished=(), on_epoch=None,
              on_model=None[, options][, received]) -> tuple[State, list[State]]
        # one visit's local training from the received model m0: (what the site sends, its pool);
        # a strategy whose entry declares options gets them as ``options=`` (a typed dict: the
        # declared ones given or at their default, already checked; fedrelay/params.py options);
        # one whose train takes ``received`` gets whether m0 came from a predecessor (False at
        # a run's first site, where m0 is the warm-up; peer/training.py run_site)
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

**Options.** A strategy or aggregator declares its options in its entry (:class:`Option`: name,
type, default, range or choices, help); a plan's own options are :data:`PLAN_OPTIONS`, the run's
training recipe that every strategy reads (learning-rate schedule, augmentation) :data:`RECIPE_OPTIONS`. Everything
else is derived from that one declaration: ``coordinator start-chain``'s flags (``--name-with-
dashes``) and its ``--config`` file's keys, the checks (``fedrelay.params.check``: by the CLI, the
coordinator and the peer, each option for the strategies that read it), the wire (an option
without a ``TrainingParams`` field of its own travels as text in ``TrainingParams.method_options``),
and the typed dict the peer hands the method (``fedrelay.params.options``: ``Context.options``,
``site_extras(..., options, ...)``).

**Plug-ins.** :func:`register` adds entries at run time; the environment variable
``FEDRELAY_METHODS`` (``module:attr`` comma-separated; ``attr`` an entry or a sequence of entries)
names entries every process (CLI, coordinator, peer daemon and its workers) registers as it
imports this module, e.g. a method kept outside this repository.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


ARCHS = ("cnn", "resnet18", "cnn-gn", "cnn-wide")  # the model zoo (fedrelay/tasks/image_folder/models.py builds them)


CHAIN, STAR = "chain", "star"
PLANS = (CHAIN, STAR)
KINDS = (int, float, str)
PLUGINS_ENV = "FEDRELAY_METHODS"


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def check_value(flag: str, kind: type, value, *, minimum: float | None = None, maximum: float | None = None,
                positive: bool = False, choices: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``value`` is a ``kind`` (int, float: a finite
    number, str) within ``minimum`` .. ``maximum`` (inclusive), > 0 when ``positive``, and one of
    ``choices`` when given (strings)."""
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{flag} must be a string, got {value!r}")
        if choices and value not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{flag} must be an integer, got {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value!r}")
    lo, hi = minimum, maximum
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ValueError(f"{flag} must be between {_num(lo)} and {_num(hi)}, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{flag} must be > 0, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{flag} must be >= {_num(lo)}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{flag} must be <= {_num(hi)}, got {value!r}")


@dataclass(frozen=True)
class Option:
    """One option of a method, declared once (see the module docstring for what derives from it).

    Attributes:
        name: the run parameters' key, snake_case (``maecho_tau``); unique over every registered
            method. Its flag is ``--`` + the name with ``-`` for ``_`` (``--maecho-tau``).
        kind: ``int``, ``float`` or ``str``.
        default: the value when the option is not given (of ``kind``).
        help: one line for ``start-chain --help``.
        minimum, maximum: the allowed range, inclusive (numbers; ``None``: unbounded).
        positive: floats: the value must be > 0.
        choices: strings: the allowed values (empty: any label).
    """

    name: str
    kind: type
    default: object
    help: str
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower() or self.name.startswith("_"):
            raise ValueError(f"option name {self.name!r} must be a lower-case Python identifier (snake_case)")
        if self.kind not in KINDS:
            raise ValueError(f"option {self.name}: kind must be int, float or str, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        try:
            self.check(self.default)
        except ValueError as exc:
            raise ValueError(f"option {self.name}: its default is not allowed ({exc})") from None

    @property
    def flag(self) -> str:
        """The ``start-chain`` flag: ``--`` + the name, ``-`` for ``_``."""
        return "--" + self.name.replace("_", "-")

    def check(self, value) -> None:
        """Raise ``ValueError`` naming :attr:`flag` unless ``value`` has the declared type and
        lies in the declared range or choices."""
        check_value(self.flag, self.kind, value, minimum=self.minimum, maximum=self.maximum,
                    positive=self.positive, choices=self.choices)

    def encode(self, value) -> str:
        """``value`` as the wire's text (``TrainingParams.method_options``): ``repr`` of a
        float (exact round trip), ``str`` of an int or a string."""
        return repr(float(value)) if self.kind is float and not isinstance(value, bool) else str(value)

    def decode(self, text: str):
        """The wire's text as ``kind``; text that does not parse is returned as is (the check
        then refuses it, naming the flag)."""
        if self.kind is str:
            return text
        try:
            return int(text) if self.kind is int else float(text)
        except ValueError:
            return text


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str    # one line, for --help and the docs
    plan: str       # the plan it runs on: "chain" or "star" (coordinator/plan.py)
    module: str     # what the peer imports to run a site's local training
    aggregator: str = ""   # star plans: the aggregator (AGGREGATORS) the aggregating site runs
    init: str = "shared"   # the initial model when --init is not given (fedrelay/params.py INITS)
    options: tuple[Option, ...] = ()   # its own options (besides its aggregator's and its plan's)
    # Why differential privacy at the sites (fedrelay/privacy.py) does not cover its training
    # (besides its aggregator's ``outside_dp``); "" = it does.
    outside_dp: str = ""


@dataclass(frozen=True)
class Aggregator:
    name: str
    summary: str
    module: str
    options: tuple[Option, ...] = ()   # what Context.options and site_extras' options carry for it
    # Why it needs one initial model for every site (refuses --init per-site); "" = it does not.
    one_initial_model: str = ""
    # Why differential privacy at the sites (fedrelay/privacy.py) does not cover what its uploads
    # or its result release; "" = it does (every tensor comes from a site's DP-SGD training). A
    # new aggregator is outside DP until its entry says otherwise.
    outside_dp: str = "it does not declare that DP-SGD covers what it releases"
    # The option (of ``options``) giving the epochs it trains at the aggregating site after the
    # sites' training, counted in a run's planned epochs (the progress bar); "" = none.
    epochs_option: str = ""


# The plans' own options: read by every strategy of the plan.
PLAN_OPTIONS: dict[str, tuple[Option, ...]] = {
    CHAIN: (),
    STAR: (Option("upload_timeout", float, 3600.0, "Parallel methods: seconds the aggregator waits for the uploads "
                  "after its own training, then combines what arrived.", minimum=0.0, positive=True),),
}

# The run's training recipe: read by every strategy of every plan (the peer's TrainConfig holds
# them; fedrelay/peer/training_loop.py ``fit`` applies them to each model it trains), so that the
# methods compared under one recipe differ only in the method. At their defaults they change
# nothing: no scheduler, no augmentation, no extra random draw.
LR_SCHEDULES = ("constant", "cosine")
AUGMENTATIONS = ("none", "flip-crop")
RECIPE_OPTIONS: tuple[Option, ...] = (
    Option("lr_schedule", str, "constant", "Every method: the learning rate per optimiser step: constant (--lr) | "
           "cosine (from --lr to 0 over each trained model's epochs x batches).", choices=LR_SCHEDULES),
    Option("augment", str, "none", "Every method: train-time augmentation of the task's training batches: none | "
           "flip-crop (images: random crop with 2-pixel zero padding + random horizontal flip).",
           choices=AUGMENTATIONS),
)

MAX_ITERATIONS = 100_000  # an int option's usual top (epochs, iterations): more is a typo, not a plan

# fedelmy-kd's and fedseq-kd's options (fedrelay's extension, issue #25: peer/strategies/fedelmy_kd.py).
KD_OPTIONS: tuple[Option, ...] = (
    # 0.75 = the probe's weight 3 over T^2 = 4: measured better than 3.0 at S = 1 (bench/RESULTS.md).
    Option("kd_weight", float, 0.75, "fedelmy-kd, fedseq-kd: weight w of the distillation towards the received "
           "model, which multiplies T^2 * KL (0: none).", minimum=0.0),
    Option("kd_temperature", float, 2.0, "fedelmy-kd, fedseq-kd: the distillation's temperature T.",
           minimum=0.0, positive=True),
    Option("kd_ce_classes", str, "all", "fedelmy-kd, fedseq-kd: all (cross-entropy over every class) | seen "
           "(over the classes the site's training split holds only, after FedRS's restricted softmax).",
           choices=("all", "seen")))
KD_OUTSIDE_DP = ("its loss reads the set of classes each site holds, which DP-SGD does not noise, and distils "
                 "outside DP-SGD's per-sample clipping")

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("fedelmy", "a model pool per site, diversity-regularised (FedELMY, Wang et al. 2024, Alg. 1)",
             CHAIN, "fedrelay.peer.strategies.fedelmy"),
    Strategy("fedseq", "one model per site, plain cross-entropy for S·E epochs (sequential FL baseline)",
             CHAIN, "fedrelay.peer.strategies.fedseq"),
    # fedrelay's own extension (issue #25), not in the FedELMY paper: docs/explanation/fedelmy-kd.md.
    Strategy("fedelmy-kd", "fedrelay's extension of FedELMY, not in the paper: FedELMY's pool plus distillation "
             "towards the received model and cross-entropy over the site's classes, against forgetting under "
             "label skew", CHAIN, "fedrelay.peer.strategies.fedelmy_kd", options=KD_OPTIONS, outside_dp=KD_OUTSIDE_DP),
    Strategy("fedseq-kd", "fedrelay's ablation of fedelmy-kd, not in a paper: the FedSeq chain (one model per site, "
             "no pool) with fedelmy-kd's distillation and cross-entropy", CHAIN,
             "fedrelay.peer.strategies.fedseq_kd", options=KD_OPTIONS, outside_dp=KD_OUTSIDE_DP),
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
    Strategy("fedavg-classaware", "ablation (ours): one-shot FedAvg (uniform) plus MA-Echo's class-aware last layer "
             "alone, no projections or echoes", STAR, "fedrelay.peer.strategies.fedseq", aggregator="class-aware-mean"),
    Strategy("ofasd", "OFASD: task vectors combined with per-block coefficients distilled from the ensemble "
             "(Koshibuchi et al., Alg. 1)", STAR, "fedrelay.peer.strategies.fedseq", aggregator="ofasd"),
)}

AGGREGATORS: dict[str, Aggregator] = {a.name: a for a in (
    Aggregator("mean", "one-shot FedAvg: the mean of the uploads, sample-weighted or uniform",
               "fedrelay.peer.aggregators.mean", options=(
                   Option("weighting", str, "samples", "fedavg: samples (weights n_k / n) | uniform.",
                          choices=("samples", "uniform")),), outside_dp=""),
    Aggregator("fedelmy-pfl", "the uniform mean of the sites' pool averages (FedELMY supplementary Alg. 2)",
               "fedrelay.peer.aggregators.fedelmy_pfl", outside_dp=""),
    Aggregator("maecho", "MA-Echo Alg. 1: echo iterations in the null spaces of the sites' inputs",
               "fedrelay.peer.aggregators.maecho", options=(
                   Option("maecho_tau", int, 100, "maecho: echo iterations (tau).", minimum=1, maximum=MAX_ITERATIONS),
                   Option("maecho_eta", float, 0.05, "maecho: step (eta).", minimum=0.0, positive=True),
                   Option("maecho_alpha", str, "uniform", "maecho: model weights uniform (the authors' released "
                          "code) | qp (Eq. 6, solved with cvxopt).", choices=("uniform", "qp"))),
               outside_dp="its uploads carry projection matrices computed from each site's raw features"),
    Aggregator("class-aware-mean", "MA-Echo's initial step alone: the uniform mean, the head's row c averaged over "
               "the sites holding class c", "fedrelay.peer.aggregators.class_aware",
               outside_dp="its uploads carry each site's exact train label counts"),
    Aggregator("ofasd", "OFASD Alg. 1: per-(site, block) coefficients of unit task vectors, learned by KL "
               "to the ensemble on the aggregating site's own data", "fedrelay.peer.aggregators.ofasd", options=(
                   Option("ofasd_mode", str, "block", "ofasd: block (a coefficient per site and parameter tensor) | "
                          "client (one per site).", choices=("block", "client")),
                   Option("ofasd_epochs", int, 20, "ofasd: epochs of coefficient learning over the transfer set at "
                          "the aggregator (aTLAS's 20).", minimum=1, maximum=MAX_ITERATIONS),
                   Option("ofasd_lr", float, 0.01, "ofasd: Adam learning rate of the coefficients.", minimum=0.0,
                          positive=True),
                   Option("ofasd_transfer", str, "mixup", "ofasd: transfer data: mixup (of the aggregating site's "
                          "train images, drawn afresh each epoch) | plain (those images).", choices=("mixup", "plain")),
                   Option("ofasd_mixup_alpha", float, 1.0, "ofasd: mixup's lambda ~ Beta(a, a): a.", minimum=0.0,
                          positive=True),
                   Option("ofasd_transfer_size", int, 0, "ofasd: mixup images per epoch, at least the aggregating "
                          "site's train images (0: as many as those).", minimum=0, maximum=MAX_ITERATIONS),
                   Option("ofasd_select", str, "kl", "ofasd: coefficients kept: kl (lowest KL to the ensemble on "
                          "held-out transfer data from the validation split) | accuracy (best validation "
                          "accuracy).", choices=("kl", "accuracy"))),
               one_initial_model="composes task vectors against one initial model", epochs_option="ofasd_epochs",
               outside_dp="its aggregator learns coefficients on the aggregating site's data"),
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


def options_of(name: str) -> tuple[Option, ...]:
    """The options strategy ``name`` reads: the run's recipe (:data:`RECIPE_OPTIONS`), its plan's,
    its own and its aggregator's. Raises ``ValueError`` for an unknown strategy."""
    s = strategy(name)
    return RECIPE_OPTIONS + PLAN_OPTIONS[s.plan] + s.options + (aggregator(s.aggregator).options if s.aggregator else ())


def all_options() -> tuple[Option, ...]:
    """Every declared option once, in declaration order: the aggregators', the strategies', the
    plans', the recipe's (``start-chain``'s flags follow this order)."""
    seen: dict[str, Option] = {}
    for o in [o for a in AGGREGATORS.values() for o in a.options] + [o for s in STRATEGIES.values()
                                                                     for o in s.options] \
            + [o for p in PLANS for o in PLAN_OPTIONS[p]] + list(RECIPE_OPTIONS):
        seen.setdefault(o.name, o)
    return tuple(seen.values())


def defaults(options: Iterable[Option]) -> dict:
    """``{name: default}`` of ``options``."""
    return {o.name: o.default for o in options}


def with_defaults(name: str, options: Mapping) -> dict:
    """Aggregator ``name``'s declared options, each from ``options`` or at its default, plus
    whatever else ``options`` holds: what an aggregator module reads, called directly or by the
    peer."""
    return {**defaults(aggregator(name).options), **options}


_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every :func:`register` / :func:`unregister` (the CLI rebuilds
    its flags, ``fedrelay.params`` its tables). A listener raises ``ValueError`` to refuse the
    registered entries (a name it already uses): :func:`register` then undoes them."""
    _listeners.append(listener)


def _check_entries(strategies: Mapping[str, Strategy], aggregators: Mapping[str, Aggregator]) -> None:
    for s in strategies.values():
        if s.plan not in PLANS:
            raise ValueError(f"strategy {s.name}: plan must be one of {', '.join(PLANS)}, got {s.plan!r}")
        if (s.plan == STAR) != bool(s.aggregator):
            raise ValueError(f"strategy {s.name}: a star plan names an aggregator, a chain none")
        if s.aggregator and s.aggregator not in aggregators:
            raise ValueError(f"strategy {s.name}: unknown aggregator {s.aggregator!r}")
    declared: dict[str, Option] = {}
    for o in [o for a in aggregators.values() for o in a.options] + [o for s in strategies.values()
                                                                     for o in s.options] \
            + [o for p in PLANS for o in PLAN_OPTIONS[p]] + list(RECIPE_OPTIONS):
        if declared.setdefault(o.name, o) != o:
            raise ValueError(f"option {o.name} is declared twice, differently")


def register(*entries: Strategy | Aggregator) -> None:
    """Add strategies and aggregators (an aggregator before, or with, the strategy naming it).
    Raises ``ValueError`` for a name already taken, an unknown aggregator or plan, or an option
    declared twice differently; nothing is added then."""
    strategies, aggregators = dict(STRATEGIES), dict(AGGREGATORS)
    for e in entries:
        table = strategies if isinstance(e, Strategy) else aggregators if isinstance(e, Aggregator) else None
        if table is None:
            raise ValueError(f"not a registry entry: {e!r}")
        if e.name in table:
            raise ValueError(f"{type(e).__name__.lower()} {e.name!r} is already registered")
        table[e.name] = e
    _check_entries(strategies, aggregators)
    STRATEGIES.update((k, v) for k, v in strategies.items() if k not in STRATEGIES)
    AGGREGATORS.update((k, v) for k, v in aggregators.items() if k not in AGGREGATORS)
    try:
        for listener in _listeners:
            listener()
    except ValueError:  # e.g. an option whose name a listener's table already uses: undone
        unregister(*entries)
        raise


def unregister(*entries: Strategy | Aggregator) -> None:
    """Remove entries added by :func:`register` (tests)."""
    for e in entries:
        (STRATEGIES if isinstance(e, Strategy) else AGGREGATORS).pop(e.name, None)
    for listener in _listeners:
        listener()


class PluginError(RuntimeError):
    """``FEDRELAY_METHODS`` names an entry that cannot be imported or registered; the message
    names the variable, the item and the cause."""


def _load_plugins(spec: str) -> None:
    """Register the entries named by ``FEDRELAY_METHODS`` (``module:attr,...``).

    Raises:
        PluginError: an item's module cannot be imported, has no such attribute, or its entry
            is refused by :func:`register` (e.g. an option name already taken).
    """
    for item in filter(None, (part.strip() for part in spec.split(","))):
        module, _, attr = item.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr or "METHODS")
            register(*(found if isinstance(found, (tuple, list)) else (found,)))
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            raise PluginError(f"{PLUGINS_ENV}={spec}: cannot register {item!r}: {exc}; fix or unset "
                              f"{PLUGINS_ENV}") from exc


def load(name: str):
    """Import the module that runs strategy ``name`` (peer side; imports torch)."""
    return importlib.import_module(strategy(name).module)


def load_aggregator(name: str):
    """Import aggregator ``name``'s module (peer side; imports torch)."""
    return importlib.import_module(aggregator(name).module)


_check_entries(STRATEGIES, AGGREGATORS)
if os.environ.get(PLUGINS_ENV):
    _load_plugins(os.environ[PLUGINS_ENV])
