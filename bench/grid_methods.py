"""What a cell of the full-data grid (``bench.grid``) runs: its methods, each one's ``coordinator
start-chain`` arguments (:class:`GridConfig`), and the **recipe** every method of a table shares
(:data:`RECIPES`: learning-rate schedule, augmentation, model; issue #25 item 1).

A recipe's arguments are added to every method's, so the methods of one table differ only by the
method. A recipe flag this build's ``start-chain`` lacks (probed from ``start-chain --help``) is
dropped when the recipe asks for what the build does anyway (``--lr-schedule constant``,
``--augment none``), and refused otherwise (:func:`check_build`), so that a table never silently
mixes recipes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from dataclasses import dataclass

from deploy.processes import tool

CHAINS = ("fedelmy", "fedelmy-kd", "fedelmy-kd-nod", "fedseq-kd", "fedseq_last_epoch", "fedseq_best_val")
STARS = ("fedavg", "fedavg_uniform", "fedavg-classaware", "fedelmy-pfl", "maecho", "ofasd")
REFS = ("local_only", "centralized")
METHODS = CHAINS + STARS + REFS
# Opt in with --methods: fedseq_best_val (the weaker FedSeq at full data: bench/RESULTS.md, accuracy) and
# fedavg_uniform (FedAvg weighted as MA-Echo and fedavg-classaware weigh: the ablation's exact base).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("fedseq_best_val", "fedavg_uniform"))
FEDSEQS = ("fedseq_last_epoch", "fedseq_best_val")
LABELS = {"fedelmy": "FedELMY (paper)", "fedelmy-kd": "FedELMY-KD (ours)",
          "fedelmy-kd-nod": "FedELMY-KD without d1/d2 (ours, α = β = 0)",
          "fedseq-kd": "FedSeq-KD, last epoch (ours: the distillation without the pool)",
          "fedseq_last_epoch": "FedSeq, last epoch", "fedseq_best_val": "FedSeq, best val",
          "fedavg": "FedAvg (sample-weighted)", "fedavg_uniform": "FedAvg (uniform)",
          "fedavg-classaware": "FedAvg (uniform) + class-aware last layer", "fedelmy-pfl": "FedELMY-PFL",
          "maecho": "MA-Echo", "ofasd": "OFASD", "local_only": "local only", "centralized": "centralized"}
STRATEGY = {"fedelmy-kd-nod": "fedelmy-kd", "fedseq_last_epoch": "fedseq", "fedseq_best_val": "fedseq",
            "fedavg_uniform": "fedavg"}


@dataclass(frozen=True)
class Recipe:
    """A training recipe: the ``start-chain`` flags it sets (flag -> value) and, for the in-process
    references, the ``TrainConfig`` fields they mean (field -> value)."""

    name: str
    about: str
    lr_schedule: str
    augment: str
    model: str

    def flags(self, model: str | None = None) -> dict[str, str]:
        return {"--model": model or self.model, "--lr-schedule": self.lr_schedule, "--augment": self.augment}

    def train_options(self) -> dict[str, str]:
        return {"lr_schedule": self.lr_schedule, "augment": self.augment}


RECIPES = {
    "paper": Recipe("paper", "constant learning rate, no augmentation (the papers' recipe)", "constant", "none", "cnn"),
    "ours": Recipe("ours", "cosine learning-rate schedule, flip-and-crop augmentation", "cosine", "flip-crop",
                   "cnn-gn"),
}
# What a build without the flag does: a recipe asking for it needs no flag there.
BUILD_DEFAULTS = {"--lr-schedule": "constant", "--augment": "none"}


def recipe_tag(recipe: str, model: str | None = None) -> str:
    """The cells' folder of a recipe with a model: ``paper-cnn``, ``ours-cnn-gn``, ``ours-cnn-wide``."""
    return f"{recipe}-{model or RECIPES[recipe].model}"


def probe_start_chain() -> tuple[set[str], set[str]]:
    """(the long flags, the strategies) this build's ``coordinator start-chain --help`` lists."""
    res = subprocess.run([tool("coordinator"), "start-chain", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "1000", "NO_COLOR": "1"}, timeout=300)
    flags = set(re.findall(r"--[a-z0-9][a-z0-9-]*", res.stdout))
    m = re.search(r"<(fedelmy\|[^>]*)>", res.stdout)
    return flags, set(m.group(1).split("|")) if m else set()


def check_build(recipe: Recipe, model: str, methods: list[str], flags: set[str],
                strategies: set[str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(the recipe's ``start-chain`` flags this build takes, the methods it cannot run -> why,
    notes). Raises ``SystemExit`` naming ``--recipe`` or ``--model`` when the build cannot run the
    recipe."""
    from fedrelay.tasks.image_folder.architectures import MODELS

    if model not in MODELS:
        raise SystemExit(f"--model {model}: this build's image-folder task has {', '.join(MODELS)}")
    take, notes = {}, []
    for flag, value in recipe.flags(model).items():
        if flag in flags:
            take[flag] = value
        elif BUILD_DEFAULTS.get(flag) == value:
            notes.append(f"`start-chain {flag}` is not in this build; its behaviour is {flag} {value}")
        else:
            raise SystemExit(f"--recipe {recipe.name}: needs `coordinator start-chain {flag} {value}`, which this "
                             "build lacks")
    cannot = {m: f"strategy {STRATEGY.get(m, m)} is not in this build (`coordinator start-chain --help`)"
              for m in methods if m not in REFS and STRATEGY.get(m, m) not in strategies}
    return take, cannot, notes


def reference_options(recipe: Recipe, train_config_fields: set[str]) -> dict[str, str]:
    """The ``TrainConfig`` fields the references set for ``recipe``: those the build has; one it
    lacks is left out when the build's behaviour is the recipe's, else ``ValueError``."""
    out = {}
    for name, value in recipe.train_options().items():
        if name in train_config_fields:
            out[name] = value
        elif BUILD_DEFAULTS.get("--" + name.replace("_", "-")) != value:
            raise ValueError(f"recipe {recipe.name}: TrainConfig has no field {name!r} (this build cannot train "
                             "the references with it)")
    return out


def train_config_fields() -> set[str]:
    from fedrelay.peer.training import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)}


class GridConfig:
    """The settings every cell of one study shares, and each method's ``start-chain`` arguments
    (``bench.runs.start_chain`` calls :meth:`chain_args`)."""

    def __init__(self, args, recipe_flags: dict[str, str]):
        self.S, self.E, self.Ew = args.S, args.E, args.warmup_epochs
        self.alpha, self.beta = args.alpha, args.beta
        self.sites, self.max_train = args.sites, args.max_train_per_site
        self.tau, self.eta = args.maecho_tau, args.maecho_eta
        self.recipe_flags = recipe_flags
        self.extra = {}
        for spec in args.method_args:
            method, _, rest = spec.partition("=")
            if method not in METHODS or not rest:
                raise SystemExit(f"--method-args {spec!r}: expected METHOD='FLAGS' with METHOD one of "
                                 f"{', '.join(METHODS)}")
            self.extra.setdefault(method, []).extend(rest.split())

    @property
    def split_tag(self) -> str:  # bench.sites.make_split's folder
        return f"n{self.sites}-max{self.max_train or 'all'}"

    @property
    def study(self) -> str:
        """The default study name: what the cells of one study share besides recipe, Dirichlet,
        seed and method."""
        data = "full" if not self.max_train else f"max{self.max_train}"
        return f"fmnist-n{self.sites}-{data}-S{self.S}-E{self.E}-Ew{self.Ew}"

    def chain_args(self, method: str) -> list[str]:
        """``start-chain`` arguments of ``method`` (a chain or star of :data:`METHODS`)."""
        common = ["-S", str(self.S), "-E", str(self.E), "--warmup-epochs", str(self.Ew), "--init", "shared"]
        for flag, value in self.recipe_flags.items():
            common += [flag, value]
        ab = ["--alpha", f"{self.alpha:g}", "--beta", f"{self.beta:g}"]
        own = {"fedelmy": [*ab, "--selection", "best-val"], "fedelmy-kd": [*ab, "--selection", "best-val"],
               "fedelmy-kd-nod": ["--alpha", "0", "--beta", "0", "--selection", "best-val"],
               "fedseq-kd": ["--selection", "last-epoch"],
               "fedseq_last_epoch": ["--selection", "last-epoch"], "fedseq_best_val": ["--selection", "best-val"],
               "fedavg": ["--weighting", "samples"], "fedavg_uniform": ["--weighting", "uniform"],
               "fedavg-classaware": [],
               "fedelmy-pfl": [*ab, "--selection", "best-val"],
               "maecho": ["--maecho-tau", str(self.tau), "--maecho-eta", f"{self.eta:g}", "--maecho-alpha",
                          "uniform"], "ofasd": []}[method]
        return ["--strategy", STRATEGY.get(method, method), *own, *common, *self.extra.get(method, [])]

    def config(self) -> dict:
        return {"sites": self.sites, "max_train_per_site": self.max_train, "S": self.S, "E": self.E, "Ew": self.Ew,
                "alpha": self.alpha, "beta": self.beta, "maecho_tau": self.tau, "maecho_eta": self.eta,
                "init": "shared", "method_args": self.extra}
