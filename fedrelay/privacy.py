"""Differential privacy at the site: a run's DP-SGD options and what a site reports it spent.

Torch-free (the CLI, the coordinator and the peer daemon read it); the training side, with
Opacus, is :mod:`fedrelay.peer.privacy`. The user's guide is ``docs/differential-privacy.md``.

**The options** (declared once, in :data:`OPTIONS`, from which ``coordinator start-chain``'s flags,
the checks and the wire (``TrainingParams`` fields 280-283) follow; ``fedrelay.registry.Option``):

* ``dp_noise_multiplier`` (``--dp-noise-multiplier``, sigma >= 0): the Gaussian noise's standard
  deviation relative to the clipping norm (Abadi et al. 2016, "Deep Learning with Differential
  Privacy", Alg. 1). 0 (the default) = DP off, unless ``dp_epsilon`` is set.
* ``dp_epsilon`` (``--dp-epsilon``, epsilon > 0): a target instead of sigma: each site picks the
  sigma that spends about this epsilon (at ``dp_delta``) over all its DP training in the run
  (Opacus ``get_noise_multiplier``, RDP accountant). 0 = none. Give one of the two, not both.
* ``dp_max_grad_norm`` (``--dp-max-grad-norm``, C > 0, default 1.0): each sample's gradient is
  clipped to this L2 norm before the noise is added.
* ``dp_delta`` (``--dp-delta``, 0 < delta < 1, default 1e-5): the delta of the (epsilon, delta)
  guarantee a site reports (and targets).

DP is off by default: a run without these options trains exactly as before (same arithmetic,
same digests).

**Which strategies** (:func:`covered`, from the registry's entries: a chain strategy, or a star
strategy whose aggregator declares ``outside_dp=""``): those whose every released tensor comes from a site's
DP-SGD training: ``fedelmy``, ``fedseq`` (chains, one-shot or ``--rounds``), ``fedavg`` and
``fedelmy-pfl`` (stars). ``maecho`` (its uploads carry projection matrices computed from the
site's raw features) and ``ofasd`` (its aggregator learns coefficients on the aggregating site's
data) are refused: DP-SGD would not cover what they release; so are ``fedelmy-kd`` and ``fedseq-kd`` (their loss
reads the set of classes a site holds; ``fedrelay.registry.Strategy.outside_dp``). DP also needs ``--selection
last-epoch``: best-validation selection picks an epoch by the validation split's accuracy,
which DP-SGD's accounting does not cover.

**What a site reports** (:func:`spent`): after the run, in its signed evaluation (the
``"privacy"`` key of ``EvaluateReply.stats_json``, kept in the ledger's evaluations row as the
site signed it): ``{"epsilon", "delta", "noise_multiplier", "max_grad_norm", "steps",
"sample_rate", "accountant": "rdp"}``, the (epsilon, delta) the site spent over all its training
of the run (warm-up, every pool model, every round), composed by Opacus' RDP accountant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedrelay import registry
from fedrelay.registry import Option

__all__ = ["covered", "refusal", "OPTIONS", "FLAGS", "DEFAULTS", "Options", "options", "check", "enabled", "planned_epochs",
           "planned_epochs_of", "spent_from_stats", "describe", "describe_options", "to_pb", "from_pb"]

# The DP options of every run (whatever its strategy: :func:`check` refuses DP on for the others).
OPTIONS = (
    Option("dp_noise_multiplier", float, 0.0, "Differential privacy (DP-SGD at every site, "
           "docs/differential-privacy.md): the noise multiplier sigma (0: DP off).", minimum=0.0),
    Option("dp_epsilon", float, 0.0, "DP: a target epsilon each site spends over the run, instead of "
           "--dp-noise-multiplier (0: none).", minimum=0.0),
    Option("dp_max_grad_norm", float, 1.0, "DP: the L2 norm each sample's gradient is clipped to (C).",
           minimum=0.0, positive=True),
    Option("dp_delta", float, 1e-5, "DP: the delta of each site's (epsilon, delta).", minimum=0.0, positive=True),
)
FLAGS = {o.name: o.flag for o in OPTIONS}
DEFAULTS = {o.name: o.default for o in OPTIONS}
BOOK = "privacy.json"   # a visit's DP steps, in its folder at the site (fedrelay.peer.privacy.Book)
MAX_NOISE = 1000.0   # sigma; more is a typo (the model would learn nothing)
MAX_EPSILON = 1e4


class Options(dict):
    """A run's DP options, resolved: ``noise_multiplier`` (sigma, 0 when a target is given),
    ``epsilon`` (the target, 0 when sigma is given), ``max_grad_norm`` (C), ``delta``."""


def _value(d: Mapping, name: str) -> float:
    """``d[name]``, or its default when unset or 0 (proto3 cannot tell unset from zero)."""
    return d.get(name) or DEFAULTS[name]


def enabled(d: Mapping) -> bool:
    """Whether the run's parameters ``d`` (a ``fedrelay.params`` dict or a ``TrainingParams``)
    turn DP-SGD on: a noise multiplier or a target epsilon above 0."""
    get = d.get if isinstance(d, Mapping) else (lambda k, default=None: getattr(d, k, default))
    return bool((get("dp_noise_multiplier", 0.0) or 0.0) > 0 or (get("dp_epsilon", 0.0) or 0.0) > 0)


def check(d: Mapping) -> None:
    """Raise ``ValueError`` naming the flag of the first bad DP option of the run's parameters
    ``d``: a value that is not a finite number, sigma < 0 or > 1000, epsilon < 0 or > 10^4, both
    sigma and epsilon, C <= 0, delta outside (0, 1); and, with DP on, a strategy DP-SGD does not
    cover (:func:`covered`) or ``--selection best-val``. Unset (0) C and delta take their
    defaults."""
    for name, flag in FLAGS.items():
        value = d.get(name, DEFAULTS[name])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value!r}")
    sigma, eps = d.get("dp_noise_multiplier", 0.0), d.get("dp_epsilon", 0.0)
    if not 0 <= sigma <= MAX_NOISE:
        raise ValueError(f"--dp-noise-multiplier must be between 0 (DP off) and {MAX_NOISE:g}, got {sigma!r}")
    if not 0 <= eps <= MAX_EPSILON:
        raise ValueError(f"--dp-epsilon must be between 0 (no target) and {MAX_EPSILON:g}, got {eps!r}")
    if sigma > 0 and eps > 0:
        raise ValueError(f"give --dp-noise-multiplier ({sigma:g}) or --dp-epsilon ({eps:g}), not both: a target "
                         "epsilon sets the noise multiplier")
    norm, delta = _value(d, "dp_max_grad_norm"), _value(d, "dp_delta")
    if norm <= 0:
        raise ValueError(f"--dp-max-grad-norm must be > 0 (the L2 norm each sample's gradient is clipped to), "
                         f"got {norm!r}")
    if not 0 < delta < 1:
        raise ValueError(f"--dp-delta must be between 0 and 1 (exclusive; usually below 1 / the samples of a "
                         f"site), got {delta!r}")
    if not enabled(d):
        return
    strategy = d.get("strategy", "")
    why = refusal(strategy)
    if why:
        raise ValueError(f"--strategy {strategy}: differential privacy (--dp-noise-multiplier / --dp-epsilon) is "
                         f"not available, {why}, outside DP-SGD's guarantee; use one of {', '.join(covered())}")
    if d.get("selection") == "best-val":
        raise ValueError("--selection best-val picks each model's epoch by its validation accuracy, which DP-SGD's "
                         "accounting does not cover: use --selection last-epoch with --dp-noise-multiplier / "
                         "--dp-epsilon")


def refusal(strategy: str) -> str:
    """Why DP-SGD at the sites does not cover what a run of ``strategy`` releases ("" when it
    does): a chain strategy releases only its sites' DP-trained models; a star strategy, what its
    aggregator declares (``fedrelay.registry.Aggregator.outside_dp``); a strategy that declares
    ``fedrelay.registry.Strategy.outside_dp`` (``fedelmy-kd``, ``fedseq-kd``) is refused whatever its plan."""
    s = registry.STRATEGIES.get(strategy)
    if s is None:
        return "it is not one of the strategies DP-SGD covers"
    if s.outside_dp:
        return s.outside_dp
    return registry.aggregator(s.aggregator).outside_dp if s.aggregator else ""


def covered() -> tuple[str, ...]:
    """The registered strategies DP-SGD covers (:func:`refusal` is "")."""
    return tuple(name for name in registry.STRATEGIES if not refusal(name))


def options(d: Mapping) -> Options | None:
    """The run's DP options resolved (:class:`Options`), or None when DP is off."""
    if not enabled(d):
        return None
    return Options(noise_multiplier=float(d.get("dp_noise_multiplier") or 0.0),
                   epsilon=float(d.get("dp_epsilon") or 0.0),
                   max_grad_norm=float(_value(d, "dp_max_grad_norm")), delta=float(_value(d, "dp_delta")))


def planned_epochs(models_per_site: int, local_epochs: int, warmup_epochs: int, visits: int,
                   warms_up: bool) -> int:
    """The epochs of DP training one site does in a run (what a target epsilon is spread over):
    ``S * E`` per visit (FedELMY's S pool models of E epochs; FedSeq's and FedAvg's one model of
    S * E epochs), times its ``visits`` (rounds), plus the warm-up's ``Ew`` at the site that makes
    the initial model (``warms_up``)."""
    return models_per_site * local_epochs * visits + (warmup_epochs if warms_up else 0)


def spent_from_stats(stats: Mapping | None) -> dict | None:
    """The ``"privacy"`` record of an evaluation's statistics (see the module docstring), or None
    when the site trained without DP. Raises ``ValueError`` for a record that is not one."""
    if not stats or "privacy" not in stats:
        return None
    p = stats["privacy"]
    if not isinstance(p, Mapping):
        raise ValueError("privacy must be a JSON object")
    for key in ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "sample_rate"):
        v = p.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (key != "epsilon" and not math.isfinite(v)) \
                or v < 0:
            raise ValueError(f"privacy.{key} must be a non-negative number, got {v!r}")
    steps = p.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"privacy.steps must be a non-negative integer, got {steps!r}")
    return dict(p)


def describe_options(params: Mapping) -> str:
    """The run's DP options in words, for ``show`` and the run page (``params``: a
    ``fedrelay.params`` dict): ``target ε 8, clipping C 1, δ 1e-05``; "" when DP is off."""
    dp = options(params)
    if dp is None:
        return ""
    asked = f"target ε {dp['epsilon']:g}" if dp["epsilon"] else f"noise multiplier σ {dp['noise_multiplier']:g}"
    return f"{asked}, clipping C {dp['max_grad_norm']:g}, δ {dp['delta']:g}"


def describe(p: Mapping | None) -> str:
    """One line for ``coordinator show`` and the run page: ``ε 3.02, δ 1e-05 (σ 1.1, C 1, 240
    steps, q 0.0625)``; "" for None."""
    if not p:
        return ""
    eps = p["epsilon"]
    eps_text = "inf" if not math.isfinite(eps) else f"{eps:.3g}"
    return (f"ε {eps_text}, δ {p['delta']:g} (σ {p['noise_multiplier']:.3g}, C {p['max_grad_norm']:g}, "
            f"{p['steps']} steps, q {p['sample_rate']:.3g})")


_PB_FIELDS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "steps", "sample_rate", "accountant")


def to_pb(p: Mapping):
    """A spent record (:func:`spent_from_stats`) as ``fedrelay.v1.PrivacySpent``."""
    from fedrelay.v1 import coordinator_pb2

    return coordinator_pb2.PrivacySpent(**{k: p[k] for k in _PB_FIELDS if k in p})


def from_pb(m) -> dict | None:
    """``fedrelay.v1.PrivacySpent`` as a dict (the ``show --json`` shape), None when unset."""
    if not m.accountant:
        return None
    return {k: getattr(m, k) for k in _PB_FIELDS}


def planned_epochs_of(params: Mapping, visits: int, warms_up: bool) -> int:
    """:func:`planned_epochs` from a run's parameters (a ``fedrelay.params`` dict)."""
    return planned_epochs(int(params["models_per_site"]), int(params["local_epochs"]), int(params["warmup_epochs"]),
                          visits, warms_up)
