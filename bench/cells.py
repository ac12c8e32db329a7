"""The one-shot accuracy grid's cells (``bench.accuracy``, reused by ``bench.few_shot``,
``bench.parallel`` and ``bench.grid``): the methods of the accuracy study, the training
configuration every cell of one study run shares (:class:`Config`, which also spells a method's
``coordinator start-chain`` arguments) and the cache of finished cells (:class:`Cache`, one JSON
file per cell)."""

from __future__ import annotations

import json
import os
from pathlib import Path

CHAIN_METHODS = ("fedelmy", "fedseq_best_val", "fedseq_last_epoch", "pool_only", "pool_d1", "pool_d2")
REF_METHODS = ("local_only", "centralized")
METHODS = CHAIN_METHODS + REF_METHODS
DOMAIN_METHODS = ("fedelmy", "fedseq_best_val", "fedseq_last_epoch")
LABELS = {"fedelmy": "FedELMY", "fedseq_best_val": "FedSeq (best val)", "fedseq_last_epoch": "FedSeq (last epoch)",
          "pool_only": "pool only", "pool_d1": "pool + d1", "pool_d2": "pool + d2", "local_only": "local only",
          "centralized": "centralized"}


def dir_key(a: float) -> str:
    """0.5 -> 'dir0_5' (the results.json key)."""
    return "dir" + f"{a:g}".replace(".", "_")


class Config:
    """The training configuration shared by every cell of one study run."""

    def __init__(self, args):
        self.S, self.E, self.Ew = args.S, args.E, args.warmup_epochs
        self.alpha, self.beta = args.alpha, args.beta
        self.sites, self.max_train = args.sites, args.max_train_per_site
        # studies without a domain-shift part (bench.few_shot) have no such arguments
        self.domain_max_train = getattr(args, "domain_max_train_per_site", None)
        self.domain_seed = getattr(args, "domain_seed", 0)

    @property
    def train_tag(self) -> str:
        return f"S{self.S}-E{self.E}-Ew{self.Ew}-a{self.alpha:g}-b{self.beta:g}"

    @property
    def split_tag(self) -> str:
        return f"n{self.sites}-max{self.max_train or 'all'}"

    @property
    def domain_tag(self) -> str:
        return f"rot-max{self.domain_max_train or 'all'}-seed{self.domain_seed}"

    def chain_args(self, method: str) -> list[str]:
        common = ["-S", str(self.S), "-E", str(self.E), "--warmup-epochs", str(self.Ew)]
        if method.startswith("fedseq"):
            sel = "best-val" if method == "fedseq_best_val" else "last-epoch"
            return ["--strategy", "fedseq", "--selection", sel, *common]
        alpha, beta = {"fedelmy": (self.alpha, self.beta), "pool_only": (0.0, 0.0),
                       "pool_d1": (self.alpha, 0.0), "pool_d2": (0.0, self.beta)}[method]
        return ["--strategy", "fedelmy", "--alpha", f"{alpha:g}", "--beta", f"{beta:g}", "--selection", "best-val",
                *common]


class Cache:
    """One JSON file per finished cell: ``<workdir>/cells/<train tag>/<split tag>/<group>/<method>.json``."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts[:-1], parts[-1] + ".json")

    def get(self, *parts: str) -> dict | None:
        p = self.path(*parts)
        return json.loads(p.read_text()) if p.exists() else None

    def put(self, cell: dict, *parts: str) -> None:
        p = self.path(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(cell, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, p)

    def label_skew(self, cfg: Config) -> dict:
        """dirichlet -> seed -> method -> cell, for every cached cell of this configuration."""
        out: dict = {}
        base = self.root / cfg.train_tag / cfg.split_tag
        if not base.is_dir():
            return out
        for d in sorted(base.glob("dir*-seed*")):
            a, s = d.name[3:].split("-seed")
            for f in d.glob("*.json"):
                out.setdefault(float(a), {}).setdefault(int(s), {})[f.stem] = json.loads(f.read_text())
        return out

    def domain(self, cfg: Config) -> dict:
        """order label -> method -> cell."""
        out: dict = {}
        base = self.root / cfg.train_tag / cfg.domain_tag
        if not base.is_dir():
            return out
        for d in sorted(base.iterdir()):
            for f in d.glob("*.json"):
                out.setdefault(d.name, {})[f.stem] = json.loads(f.read_text())
        return out

