"""A site's assignments: the checks an assignment (or a rerouted part of a plan) must pass here
(its part of the plan, its task, its parameters, the site's policy, its initial weights), the
run it creates, and what every job of the run is told (``peer/jobs.py``'s ``SPEC`` and the
common fields of a training request, the run's initial model).
"""

from __future__ import annotations

from pathlib import Path

from fedrelay import params as run_params, purpose as purposes, registry, tasks as task_registry
from fedrelay.files import sha256_file
from fedrelay.peer.policy import SitePolicy
from fedrelay.peer.runs import Run
from fedrelay.peer.site import Site
from fedrelay.task import ModelSpec, canonical_json
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import common_pb2, peer_pb2


def job_spec(a: peer_pb2.Assignment) -> dict:
    """The run's model as a job's ``SPEC`` (``peer/jobs.py``)."""
    return ModelSpec.from_pb(a.model).to_dict()


def job_base(site: str, run: Run) -> dict:
    """What every training job of ``run`` at ``site`` is told: model, parameters, seed, classes, site."""
    a = run.assignment
    params = run_params.to_dict(a.params)
    strategy = registry.strategy(a.params.strategy)
    return {"spec": job_spec(a), "params": params, "seed": a.seed, "class_index": list(a.class_index),
            "site": site, "aggregator": strategy.aggregator, "options": run_params.options(params)}


def check_part(site: str, order, rounds: int, transfers, peers, visits) -> None:
    """A part of a plan ``site`` can carry out. Raises ``ValueError``."""
    sites = set(order)
    named = {ref.name for ref in peers}
    if any(not 1 <= r <= rounds for r in visits) or list(visits) != sorted(set(visits)):
        raise ValueError(f"visits {list(visits)} are not distinct rounds in 1..{rounds}")
    for t in transfers:
        if t.purpose not in purposes.BY_WIRE:
            raise ValueError(f"planned transfer with unknown purpose {t.purpose}")
        if site not in (t.sender, t.receiver) or t.sender == t.receiver:
            raise ValueError(f"planned transfer {t.sender} -> {t.receiver} is not this site's")
        other = t.receiver if t.sender == site else t.sender
        if other not in sites or other not in named:
            raise ValueError(f"planned transfer names {other!r}, which is not a site of the run with an address")
        if t.purpose == common_pb2.CHAIN_HOP and not 1 <= t.index < rounds * len(order):
            raise ValueError(f"hop {t.index} is outside the plan's {rounds * len(order) - 1} hops")
        if t.purpose == common_pb2.UPLOAD and not (1 <= t.index <= len(order) and order[t.index - 1] == t.sender):
            raise ValueError(f"upload {t.index} does not come from the site at position {t.index - 1}")


class InitialWeights:
    """The initial-weights files (``--init file``) a site holds in ``folder``, found by their SHA-256."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._digests: dict[tuple, str] = {}

    def find(self, sha256: str) -> Path:
        """Any ``*.safetensors`` file in the folder whose digest is ``sha256`` (digests are cached
        by size and modification time). Raises ``ValueError`` saying where to place it."""
        folder = self.folder
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns)
            if key not in self._digests:
                self._digests[key] = sha256_file(path)
            if self._digests[key] == sha256:
                return path
        raise ValueError(f"this site holds no initial-weights file with SHA-256 {sha256}: copy it into {folder} "
                         "(any name ending in .safetensors; `sha256sum FILE` shows its digest)")

    def initial_state(self, run: Run) -> dict | None:
        """The run's initial model, as a job's ``initial`` (``peer.jobs.initial_state``):
        ``--init file`` (the weights file found here by its SHA-256; the job checks the digest
        again as it reads it, and its tensors against the run's model), ``--init shared`` in a
        star plan (built from ``derive_seed(seed, "init")``, the same at every site). None
        otherwise: each site draws its own seeded init, and a chain's first site keeps the draw
        it always made (``derive_seed(seed, "site", 0, "init")``), so chain runs keep their
        digests. Raises ``ValueError`` (no such weights file here)."""
        opts = run_params.options(run_params.to_dict(run.assignment.params))
        if opts["init"] == "file":
            return {"kind": "file", "path": str(self.find(opts["init_sha256"])), "sha256": opts["init_sha256"]}
        if opts["init"] == "shared" and run.is_star:
            return {"kind": "shared"}
        return None


class Assignments:
    """Takes the coordinator's assignments at one site: ``offers`` (the site's tasks by name),
    ``extra_tasks`` (``module:attr`` tasks offered), ``policy`` (the site's own), ``weights``
    (its initial-weights files), ``schemas`` (``peer.schemas.PayloadSchemas``)."""

    def __init__(self, site: Site, offers: dict[str, Offer], extra_tasks: list[str], policy: SitePolicy,
                 weights: InitialWeights, schemas):
        self.site = site
        self.offers = offers
        self.extra_tasks = extra_tasks
        self.policy = policy
        self.weights = weights
        self.schemas = schemas

    def accept(self, a: peer_pb2.Assignment) -> tuple[Run, bool]:
        """Check an assignment and keep its run (idempotent): returns the run and whether it is
        new here. Raises ``ValueError`` when it cannot be run here, ``PolicyRefusal`` (a
        ``ValueError``) when a new run is outside the site's policy."""
        site = self.site
        if a.site != site.name:
            raise ValueError(f"assignment is for {a.site!r}, this peer is {site.name!r}")
        if not a.run_id or "/" in a.run_id or a.run_id.startswith("."):
            raise ValueError(f"invalid run id {a.run_id!r}")
        if a.chain_length < 2 or a.position >= a.chain_length or len(a.order) != a.chain_length:
            raise ValueError("inconsistent position, chain length and order")
        if a.order[a.position] != site.name:
            raise ValueError(f"order[{a.position}] is {a.order[a.position]!r}, not {site.name!r}")
        run_params.check_rounds(a.rounds or 1)
        star = registry.strategy(a.params.strategy).plan == registry.STAR
        if star != bool(a.aggregator) or (a.aggregator and a.aggregator not in a.order):
            raise ValueError(f"strategy {a.params.strategy!r} and aggregator {a.aggregator!r} do not make a plan")
        check_part(site.name, a.order, a.rounds or 1, a.transfers, a.peers, a.visits)
        self.check_task(ModelSpec.from_pb(a.model), list(a.class_index))
        params = run_params.to_dict(a.params)
        run_params.check(params)
        if a.run_id not in site.runs:  # a new run: within this site's policy (raises PolicyRefusal)
            self.policy.check(a)
        opts = run_params.options(params)
        if opts["init"] == "file":
            self.weights.find(opts["init_sha256"])  # refuse now, not at the first epoch
        if star and a.aggregator == site.name and a.run_id not in site.runs:
            # The aggregating site is assigned first: its aggregator must handle the task's model
            # (e.g. MA-Echo's layer types) before any site trains. A worker builds the model's
            # schema on the meta device (seconds; cached per model and options).
            self.schemas.of(a)
        with site.lock:
            run = site.runs.get(a.run_id)
            if run is not None:
                if run.assignment.route_version == 0 and run.assignment != a:
                    raise ValueError(f"run {a.run_id} was already assigned differently")
                return run, False
            folder = site.state_dir / "runs" / a.run_id
            folder.mkdir(parents=True, exist_ok=True)
            run = Run(a, folder)
            run.save_assignment(a)
            run.save()
            site.runs[a.run_id] = run
        return run, True

    def check_task(self, spec: ModelSpec, class_index: list[str]) -> None:
        """The run's task must be offered here and read this site's folder, its code here must
        have the digest the run pins (recomputed now: a copy changed since the daemon started
        counts), the site's input description must be the run's, and the site's classes must be
        in the run's class index. Raises ``ValueError`` naming the task and, for a digest, both."""
        offer = self.offers.get(spec.task)
        if offer is None:
            raise ValueError(f"task {spec.task!r} is not installed at this site (installed: "
                             f"{', '.join(sorted(self.offers)) or 'none'}): install it, or leave this site out")
        if not offer.usable:
            raise ValueError(f"task {spec.task!r} cannot read this site's data: {offer.error}")
        try:
            here = task_registry.find(spec.task, self.extra_tasks).sha256
        except task_registry.TaskNotInstalled as exc:
            raise ValueError(f"task {spec.task!r}: {exc}") from None
        if spec.task_sha256 and here != spec.task_sha256:
            raise ValueError(f"task {spec.task!r} at this site has code SHA-256 {here}, the run pins "
                             f"{spec.task_sha256}: this site's copy of the task differs from the one the run was "
                             "started with (install the agreed release)")
        mine = canonical_json(offer.summary.input)
        want = canonical_json({k: v for k, v in spec.input.items() if k != "stats"})
        if mine != want:
            raise ValueError(f"task {spec.task!r}: the run's model expects input {want}, this site's data are {mine}")
        if spec.model not in offer.models:
            raise ValueError(f"task {spec.task!r} has no model {spec.model!r} here (models: {', '.join(offer.models)})")
        missing = [c for c in offer.summary.classes if c not in set(class_index)]
        if missing:
            raise ValueError(f"this site's classes {missing} are not in the run's class index")
