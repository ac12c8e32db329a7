"""A site's own policy: which runs it accepts (``policy.toml``; docs/site-policy.md).

A hospital decides for itself what its daemon may be told to do. The policy file (TOML, read
with ``tomllib``) lives at the site, in ``peer serve --policy FILE`` or, by default,
``STATE_DIR/policy.toml``::

    accept_runs = true                  # false: refuse every new assignment (the pause switch)
    pause_reason = "scanner upgrade"    # shown to the operator while accept_runs = false
    strategies = ["fedelmy", "fedseq"]  # the strategies accepted
    operators = ["operator", "operator.alice"]  # operator identities (certificate names) accepted

    [tasks]                             # the tasks accepted, each with the code SHA-256s accepted
    image-folder = ["3f5a...e9"]        # [] or "*": any digest of that task's code
    tabular-csv = "*"

    [limits]                            # the largest values accepted (per site)
    local_epochs = 5                    # E
    warmup_epochs = 5                   # Ew
    models_per_site = 10                # S
    rounds = 3                          # T

Every key is optional; a key left out restricts nothing (no ``[tasks]`` table: any task the site
has installed). Unknown keys and values of the wrong type are errors naming the key (a typo in a
security policy must not pass silently).

The file is read again whenever it changed (by size and modification time), at each assignment:
flipping ``accept_runs`` takes effect for the next run without restarting the daemon. Runs
already accepted carry on. A policy file that was given with ``--policy`` and is gone, or one
that no longer parses, refuses every assignment (fail closed) until it is fixed.

What a policy checks is the assignment the coordinator sent (``peer_pb2.Assignment``): the
task and the code digest pinned in its ``ModelSpec`` (which ``PeerNode.check_task`` has
already compared with the code installed here), the strategy and epochs of its
``TrainingParams``, its rounds, and ``operator``, the certificate name of the operator who
started the run, as the coordinator authenticated it (the site trusts the coordinator's word
on who the operator is: the coordinator is the only identity allowed to assign).
"""

from __future__ import annotations

import os
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fedrelay import registry
from fedrelay.task import ModelSpec

POLICY_FILE = "policy.toml"  # in the site's state dir: the policy when --policy is not given
ANY = "*"
LIMITS = {  # [limits] key -> (the assignment's value, what the operator's flag is called)
    "local_epochs": "--local-epochs (E)",
    "warmup_epochs": "--warmup-epochs (Ew)",
    "models_per_site": "--models-per-site (S)",
    "rounds": "--rounds (T)",
}
TOP_KEYS = ("accept_runs", "pause_reason", "strategies", "operators", "tasks", "limits")


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file and the key."""


class PolicyRefusal(ValueError):
    """An assignment outside the site's policy; the message says which rule and why."""


@dataclass(frozen=True)
class Policy:
    """A parsed policy (``None`` fields restrict nothing).

    ``tasks``: task name -> accepted code SHA-256s (lowercase hex; an empty tuple: any digest).
    ``limits``: ``LIMITS`` key -> largest value accepted (>= 0).
    """

    accept_runs: bool = True
    pause_reason: str = ""
    strategies: tuple[str, ...] | None = None
    operators: tuple[str, ...] | None = None
    tasks: dict[str, tuple[str, ...]] | None = None
    limits: dict[str, int] | None = None

    def check(self, assignment) -> None:
        """Raise ``PolicyRefusal`` unless ``assignment`` (a ``peer_pb2.Assignment``) is within
        this policy; checked in the order: pause switch, operator, task, strategy, limits."""
        if not self.accept_runs:
            why = f": {self.pause_reason}" if self.pause_reason else ""
            raise PolicyRefusal(f"this site accepts no runs right now (accept_runs = false){why}")
        operator = assignment.operator
        if self.operators is not None and operator not in self.operators:
            who = repr(operator) if operator else "an unknown operator (plaintext coordinator)"
            raise PolicyRefusal(f"the run was started by {who}; this site accepts runs from "
                                f"{', '.join(self.operators) or 'no operator'} (operators)")
        spec = ModelSpec.from_pb(assignment.model)
        if self.tasks is not None:
            if spec.task not in self.tasks:
                raise PolicyRefusal(f"task {spec.task!r} is not accepted here (tasks: "
                                    f"{', '.join(sorted(self.tasks)) or 'none'})")
            digests = self.tasks[spec.task]
            if digests and spec.task_sha256.lower() not in digests:
                pinned = spec.task_sha256 or "no digest"
                raise PolicyRefusal(f"task {spec.task!r} with code SHA-256 {pinned} is not accepted here "
                                    f"(tasks.{spec.task} lists {len(digests)} other digest(s))")
        strategy = assignment.params.strategy
        if self.strategies is not None and strategy not in self.strategies:
            raise PolicyRefusal(f"strategy {strategy!r} is not accepted here (strategies: "
                                f"{', '.join(self.strategies) or 'none'})")
        values = {"local_epochs": assignment.params.local_epochs, "warmup_epochs": assignment.params.warmup_epochs,
                  "models_per_site": assignment.params.models_per_site, "rounds": assignment.rounds or 1}
        for key, largest in (self.limits or {}).items():
            if values[key] > largest:
                raise PolicyRefusal(f"{LIMITS[key]} {values[key]} is more than this site accepts "
                                    f"(limits.{key} = {largest})")


def parse(text: str, source: str = "policy") -> Policy:
    """The policy in TOML ``text``. Raises ``PolicyError`` naming ``source`` and the key."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - set(TOP_KEYS))
    if unknown:
        raise PolicyError(f"{source}: unknown key {unknown[0]!r} (keys: {', '.join(TOP_KEYS)})")

    def bad(key: str, want: str, value) -> PolicyError:
        return PolicyError(f"{source}: {key} must be {want}, not {value!r}")

    accept = doc.get("accept_runs", True)
    if not isinstance(accept, bool):
        raise bad("accept_runs", "true or false", accept)
    reason = doc.get("pause_reason", "")
    if not isinstance(reason, str):
        raise bad("pause_reason", "a string", reason)

    def names(key: str, known=None) -> tuple[str, ...] | None:
        if key not in doc:
            return None
        value = doc[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise bad(key, "a list of names", value)
        for v in value:
            if known is not None and v not in known:
                raise PolicyError(f"{source}: {key}: unknown strategy {v!r} (known: {', '.join(known)})")
        return tuple(value)

    tasks = None
    if "tasks" in doc:
        if not isinstance(doc["tasks"], dict):
            raise bad("tasks", "a table of task name = [code SHA-256, ...] or \"*\"", doc["tasks"])
        tasks = {}
        for name, digests in doc["tasks"].items():
            key = f"tasks.{name}"
            if digests == ANY:
                digests = []
            if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
                raise bad(key, 'a list of code SHA-256s or "*"', digests)
            for d in digests:
                if len(d) != 64 or any(c not in "0123456789abcdef" for c in d.lower()):
                    raise bad(key, "SHA-256s (64 hex digits; `coordinator peers` shows what each site runs)", d)
            tasks[name] = tuple(d.lower() for d in digests)
    limits = None
    if "limits" in doc:
        if not isinstance(doc["limits"], dict):
            raise bad("limits", "a table", doc["limits"])
        limits = {}
        for key, value in doc["limits"].items():
            if key not in LIMITS:
                raise PolicyError(f"{source}: unknown key 'limits.{key}' (limits: {', '.join(LIMITS)})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"limits.{key}", "a whole number >= 0", value)
            limits[key] = value
    return Policy(accept_runs=accept, pause_reason=reason, strategies=names("strategies", tuple(registry.STRATEGIES)),
                  operators=names("operators"), tasks=tasks, limits=limits)


def load(path: str | Path) -> Policy:
    """The policy in the file ``path``. Raises ``PolicyError`` (unreadable file, bad TOML, bad key)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read the policy file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse(text, str(path))


class SitePolicy:
    """The site's policy file, read again when it changed. Thread-safe.

    ``path``: the file; ``required``: it was named explicitly (``peer serve --policy``), so a
    missing file refuses assignments; otherwise (the state dir's ``policy.toml``) a missing file
    means no policy. Construct with :meth:`at` to check the file once at start-up.
    """

    def __init__(self, path: str | Path, required: bool = False):
        self.path = Path(path)
        self.required = required
        self._lock = threading.Lock()
        self._seen: tuple | None = None
        self._policy: Policy | None = None
        self._error: str = ""

    @classmethod
    def at(cls, path: str | Path | None, state_dir: str | Path) -> "SitePolicy":
        """The policy of a daemon: ``path`` (``--policy``; must exist and parse) or the state
        dir's ``policy.toml``. Raises ``PolicyError`` for a bad file at start-up."""
        policy = cls(path, required=True) if path else cls(Path(state_dir) / POLICY_FILE)
        policy.current()
        return policy

    def current(self) -> Policy | None:
        """The policy now (``None``: no policy file, every run within the site's other checks
        is accepted). Raises ``PolicyError`` while the file is missing (when required) or bad."""
        try:
            st = os.stat(self.path)
            seen = (st.st_size, st.st_mtime_ns, st.st_ino)
        except FileNotFoundError:
            if self.required:
                raise PolicyError(f"the policy file {self.path} (--policy) is missing") from None
            return None
        except OSError as exc:
            raise PolicyError(f"cannot read the policy file {self.path}: {exc.strerror}") from None
        with self._lock:
            if seen != self._seen:
                try:
                    self._policy, self._error = load(self.path), ""
                except PolicyError as exc:
                    self._policy, self._error = None, str(exc)
                self._seen = seen
            if self._error:
                raise PolicyError(self._error)
            return self._policy

    def check(self, assignment) -> bool:
        """Raise ``PolicyRefusal`` unless the current policy accepts ``assignment``; a policy
        file that cannot be used refuses it too (naming the problem). Returns whether there is
        a policy (False: no policy file, nothing was checked)."""
        try:
            policy = self.current()
        except PolicyError as exc:
            raise PolicyRefusal(f"this site's policy file is unusable, so it accepts no runs: {exc}") from None
        if policy is not None:
            policy.check(assignment)
        return policy is not None
