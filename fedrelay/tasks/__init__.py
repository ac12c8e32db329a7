"""Where a site's tasks come from, and which code each one is: discovery, digests, loading.

A site offers the tasks installed in its Python environment:

* the built-in ones, :data:`BUILTIN` (``image-folder``, the default, and ``tabular-csv``);
* every entry point of the group ``fedrelay.tasks`` (a task package's ``pyproject.toml``:
  ``[project.entry-points."fedrelay.tasks"] my-task = "my_task:MyTask"``; ``fedrelay new-task``
  writes one);
* ``module:attr`` names given to ``peer serve --task`` (a module on the daemon's path).

**The task's digest** (:func:`digest`) is the SHA-256 of the task's code as installed, computed
from the files without importing them: every file of the task's top-level package (for a
built-in task, its own subpackage or module under ``fedrelay/tasks/``), ``__pycache__`` folders
and compiled ``.pyc`` files left out, in sorted order of their relative path, each as the line
``<relative path> NUL <SHA-256 of its bytes> LF``; the digest is the SHA-256 of those lines. It
is the same on every machine where the same files are installed (wheel or editable install,
any folder), and changes when any byte of the task's code does. A run pins the digest; a site
whose copy differs refuses the assignment, and a worker checks it again before it imports the
task (:func:`load`).

Everything here but :func:`load`/:func:`resolve` is free of torch and of task code (the daemon
and the coordinator use it); :func:`load` imports the task, in a worker.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from fedrelay.task import ModelSpec, Task

__all__ = ["BUILTIN", "DEFAULT", "GROUP", "Installed", "TaskNotInstalled", "installed", "find", "digest",
           "load", "resolve", "use", "name_of", "check_name"]

GROUP = "fedrelay.tasks"  # the entry-point group task packages register under
DEFAULT = "image-folder"
BUILTIN = {
    "image-folder": "fedrelay.tasks.image_folder:ImageFolderTask",
    "tabular-csv": "fedrelay.tasks.tabular_csv:TabularCsvTask",
}
_BUILTIN_PACKAGE = "fedrelay.tasks"
MAX_NAME = 128


class TaskNotInstalled(LookupError):
    """The named task is not offered at this site; the message lists what is and how to install."""


@dataclass(frozen=True)
class Installed:
    """A task this site offers (found without importing it).

    Attributes:
        name: how a run names it (entry-point name, or ``module:attr``).
        target: ``module:attr`` of the :class:`fedrelay.Task` subclass.
        version: the version of the distribution that installed it (fedrelay's for built-in
            tasks), or "" when none is known.
        sha256: :func:`digest` of its code, hex.
        source: the file or folder the digest covers.
    """

    name: str
    target: str
    version: str
    sha256: str
    source: str


def check_name(name: str, what: str = "--task") -> None:
    """Raise ``ValueError`` unless ``name`` is a plausible task name: an entry-point name
    (letters, digits, ``-_.``) or ``module:attr`` (dotted identifiers), at most 128 characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise ValueError(f"{what} must be a task name of 1 to {MAX_NAME} characters, got {name!r}")
    if ":" in name:
        module, _, attr = name.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
            raise ValueError(f"{what} {name!r}: a module:attr name needs dotted identifiers, e.g. my_task:MyTask")
        return
    if not all(c.isalnum() or c in "-_." for c in name) or not name[0].isalnum():
        raise ValueError(f"{what} {name!r}: use letters, digits, '-', '_' and '.', or module:attr")


def _source(module: str) -> Path:
    """The file or folder whose files :func:`digest` covers for code in ``module``: the
    top-level package (or single-file module), or for a built-in task its own subpackage or
    module under ``fedrelay.tasks``. Raises ``TaskNotInstalled`` when it cannot be found."""
    parts = module.split(".")
    if module.startswith(_BUILTIN_PACKAGE + ".") and len(parts) > 2:
        name = ".".join(parts[:3])
    else:
        name = parts[0]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise TaskNotInstalled(f"module {name!r} cannot be found: {exc}") from None
    if spec is None:
        raise TaskNotInstalled(f"module {name!r} is not installed here (not on the Python path)")
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        if len(locations) != 1:
            raise TaskNotInstalled(f"package {name!r} is a namespace package over {len(locations)} folders: "
                                   "make it a regular package (with __init__.py) so that its code has one digest")
        return Path(locations[0])
    if not spec.origin or not Path(spec.origin).is_file():
        raise TaskNotInstalled(f"module {name!r} has no source file")
    return Path(spec.origin)


def _files(source: Path) -> list[tuple[str, Path]]:
    if source.is_file():
        return [(source.name, source)]
    found = []
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo") or not path.is_file():
            continue
        found.append((rel.as_posix(), path))
    return sorted(found)


def digest_of(source: Path) -> str:
    """The digest of the files under ``source`` (a file or folder; see the module docstring).
    Raises ``OSError`` when a file cannot be read."""
    lines = hashlib.sha256()
    for rel, path in _files(Path(source)):
        lines.update(rel.encode("utf-8") + b"\0" + hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return lines.hexdigest()


def digest(target: str) -> tuple[str, str]:
    """``(sha256, source)`` of the code of the task ``target`` (``module:attr``), from its files.
    Raises ``TaskNotInstalled``."""
    module = target.partition(":")[0]
    source = _source(module)
    try:
        return digest_of(source), str(source)
    except OSError as exc:
        raise TaskNotInstalled(f"cannot read the code of {target} under {source}: {exc}") from None


def _version_of(module: str) -> str:
    top = module.split(".")[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top) or []
        return importlib.metadata.version(dists[0]) if dists else ""
    except (importlib.metadata.PackageNotFoundError, ValueError, OSError):
        return ""


def _entry_points() -> dict[str, tuple[str, str]]:
    """name -> (module:attr, version) of the ``fedrelay.tasks`` entry points (the first of a
    name wins, in sys.path order)."""
    found: dict[str, tuple[str, str]] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name in found or ep.name in BUILTIN:
            continue
        version = ""
        try:
            version = ep.dist.version if ep.dist is not None else ""
        except (AttributeError, ValueError):
            pass
        found[ep.name] = (ep.value.replace(" ", ""), version)
    return found


def _candidates(extra: Sequence[str] = ()) -> dict[str, tuple[str, str | None]]:
    """name -> (module:attr, version or None: look it up) of every task this site could offer."""
    from fedrelay.version import __version__

    found: dict[str, tuple[str, str | None]] = {name: (target, __version__) for name, target in BUILTIN.items()}
    for name, (target, version) in _entry_points().items():
        found.setdefault(name, (target, version))
    for name in extra:
        if ":" in name:
            found.setdefault(name, (name, None))
    return found


def _installed(name: str, target: str, version: str | None) -> Installed:
    sha, source = digest(target)
    return Installed(name=name, target=target, sha256=sha, source=source,
                     version=version if version is not None else _version_of(target.partition(":")[0]))


def installed(extra: Sequence[str] = (), only: Sequence[str] | None = None) -> dict[str, Installed | TaskNotInstalled]:
    """The tasks this site offers, by name: :class:`Installed`, or the :class:`TaskNotInstalled`
    that says why a named one cannot be used. ``extra``: ``module:attr`` names (``peer serve
    --task``); ``only``: offer just these names (built-in, entry-point or ``module:attr``)."""
    candidates = _candidates([*extra, *(only or ())])
    names = list(only) if only is not None else list(candidates)
    result: dict[str, Installed | TaskNotInstalled] = {}
    for name in names:
        if name not in candidates:
            result[name] = _not_installed(name, candidates)
            continue
        try:
            result[name] = _installed(name, *candidates[name])
        except TaskNotInstalled as exc:
            result[name] = exc
    return result


def _not_installed(name: str, candidates) -> TaskNotInstalled:
    names = ", ".join(sorted(candidates)) or "none"
    return TaskNotInstalled(f"task {name!r} is not installed at this site (installed: {names}); install its "
                            f"package (pip install ...), which registers it under the entry-point group "
                            f"{GROUP!r}, or name a module on the site's path as module:attr")


def find(name: str, extra: Sequence[str] = ()) -> Installed:
    """The installed task ``name`` (see :func:`installed`), its digest computed now. Raises
    ``TaskNotInstalled`` naming the tasks that are installed and how to add one."""
    candidates = _candidates([*extra, name])
    if name not in candidates:
        raise _not_installed(name, candidates)
    return _installed(name, *candidates[name])


# --------------------------------------------------------------------------- loading (workers)

_lock = threading.Lock()
_loaded: dict[tuple[str, str], "Task"] = {}  # (name, sha256) -> the task object, per process
_used: dict[str, "Task"] = {}  # tasks given directly (use()), by name


def use(name: str, task: "Task") -> None:
    """Make ``task`` (an object) the task ``name`` in this process, without any package or
    digest: for tests, notebooks and the benchmarks that call the training functions directly."""
    with _lock:
        _used[name] = task


def load(name: str, sha256: str = "", extra: Sequence[str] = ()) -> "Task":
    """Import the task ``name`` and make its object (once per process and digest: the code a
    process imported cannot change under it). With ``sha256``, the task's files must have that
    digest when first loaded, else ``ValueError`` names both digests (the site's copy changed,
    or differs from the one the run pins). Raises ``TaskNotInstalled``, ``ValueError``,
    ``TypeError`` (the target is not a ``fedrelay.Task`` subclass) and ``ImportError`` (the
    task's module failed to import: its error)."""
    from fedrelay.task import Task

    with _lock:
        if name in _used:
            return _used[name]
        if (name, sha256) in _loaded:
            return _loaded[(name, sha256)]
    inst = find(name, extra)
    if sha256 and inst.sha256 != sha256:
        raise ValueError(f"task {name!r} here has SHA-256 {inst.sha256}, the run pins {sha256}: this site's copy "
                         f"of the task ({inst.source}) differs from the one the run was started with")
    module_name, _, attr = inst.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error in the task's code: say whose it is
        raise ImportError(f"task {name!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise TaskNotInstalled(f"task {name!r}: {module_name} has no attribute {attr!r}")
    task = obj() if isinstance(obj, type) else obj
    if not isinstance(task, Task):
        raise TypeError(f"task {name!r}: {inst.target} is not a fedrelay.Task subclass (got {type(task).__name__})")
    with _lock:
        _loaded[(name, sha256)] = task
    return task


def name_of(task: "Task") -> str:
    """The name the task object ``task`` has in this process (the one :func:`load` or
    :func:`use` made it under), for messages; its class's name for any other object. A stand-in
    that wraps a task (``__wrapped__``, e.g. the training recipe's augmenting one) is named as
    the task it wraps."""
    while getattr(task, "__wrapped__", None) is not None:
        task = task.__wrapped__
    with _lock:
        for name, t in _used.items():
            if t is task:
                return name
        for (name, _), t in _loaded.items():
            if t is task:
                return name
    return type(task).__name__


def resolve(spec: "ModelSpec") -> "Task":
    """The task object of a run's model spec (:func:`load` of ``spec.task`` pinned to
    ``spec.task_sha256`` when set). Raises like :func:`load`."""
    return load(spec.task, spec.task_sha256)
