"""``fedrelay new-task NAME``: a new task package, ready to install at a site and run as is.

The package is a copy of the template in ``fedrelay/tasks/template/`` (a working task,
``example-task``: CSV files of numeric features and a label per row, an MLP, a metric of its own,
its tests and a README), with the template's three names replaced by the new task's:

* ``example-task``  -> ``NAME``: the task's name (the entry point a site registers, the name
  ``coordinator start-chain --task`` takes) and the distribution's name (``pip``);
* ``example_task``  -> the Python package (:func:`package_name`);
* ``ExampleTask``   -> the ``fedrelay.Task`` subclass (:func:`class_name`).

No torch, no task code here: it copies text.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import keyword
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fedrelay.tasks import BUILTIN, GROUP, check_name

__all__ = ["TEMPLATE", "NewTask", "package_name", "class_name", "new_task"]

TEMPLATE = Path(__file__).resolve().parent / "template"
_NAME, _PACKAGE, _CLASS = "example-task", "example_task", "ExampleTask"
_SKIP = ("__pycache__", ".pytest_cache", ".egg-info", "build", "dist")


@dataclass(frozen=True)
class NewTask:
    """What :func:`new_task` wrote: the task's ``name``, its Python ``package`` and ``cls``
    (the ``fedrelay.Task`` subclass), in the folder ``out``."""

    name: str
    package: str
    cls: str
    out: Path

    @property
    def module_file(self) -> Path:
        """The task's code (the file to adapt)."""
        return self.out / self.package / "__init__.py"


def package_name(name: str) -> str:
    """The Python package of the task ``name``: lower case, each run of other characters than
    letters and digits made one ``_`` (``Lab-Values.v2`` -> ``lab_values_v2``); ``task_`` in
    front of a leading digit, ``_task`` after a Python keyword."""
    pkg = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    if not pkg or pkg[0].isdigit():
        pkg = "task_" + pkg
    if keyword.iskeyword(pkg) or keyword.issoftkeyword(pkg):
        pkg += "_task"
    return pkg


def class_name(name: str) -> str:
    """The task's class: the name's parts capitalised and joined, ending in ``Task``
    (``lab-values`` -> ``LabValuesTask``, ``chest-xray-task`` -> ``ChestXrayTask``)."""
    cls = "".join(p[:1].upper() + p[1:] for p in re.split(r"[^0-9A-Za-z]+", name) if p)
    if cls[:1].isdigit():
        return "Task" + cls
    return cls if cls.endswith("Task") else cls + "Task"


def _check(name: str, out: Path, pkg: str) -> None:
    """Raise ``ValueError`` unless ``name`` can become a new package in ``out``."""
    check_name(name, "NAME")
    if ":" in name:
        raise ValueError(f"NAME {name!r}: a task package's name is an entry-point name (letters, digits, '-', '_', "
                         "'.'), not module:attr")
    if not name.isascii():
        raise ValueError(f"NAME {name!r}: use ASCII letters, digits, '-', '_' and '.' (a Python distribution's name)")
    if name in BUILTIN:
        raise ValueError(f"NAME {name!r} is a built-in task of fedrelay ({', '.join(sorted(BUILTIN))}): choose "
                         "another name")
    taken = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == name]
    if taken:
        raise ValueError(f"a task named {name!r} is already installed here ({taken[0].value}, from "
                         f"{getattr(taken[0].dist, 'name', '?')}): choose another name, or uninstall it first")
    if pkg in sys.stdlib_module_names:
        raise ValueError(f"NAME {name!r} makes the Python package {pkg!r}, a module of Python's standard "
                         "library: choose another name")
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or [])
        raise ValueError(f"NAME {name!r} makes the Python package {pkg!r}, but a module of that name is already "
                         f"importable here ({where}): choose another name")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty: choose a new folder (nothing was written)")


def _replace(text: str, name: str, pkg: str, cls: str) -> str:
    return text.replace(_NAME, name).replace(_PACKAGE, pkg).replace(_CLASS, cls)


def new_task(name: str, out: Path | None = None) -> NewTask:
    """Write the task package ``name`` into the folder ``out`` (default: ``./NAME``), which must
    not exist or be empty. All or nothing: the files are written into a temporary folder beside
    ``out`` that is then renamed.

    Raises ``ValueError``: ``name`` is not a valid task name (``fedrelay.tasks.check_name``; an
    entry-point name in ASCII), a built-in task's or an installed task's name, or makes a Python
    package that already exists here; ``out`` is a file or a non-empty folder. ``OSError``: the
    folder cannot be written."""
    out = Path(out) if out is not None else Path(name)
    pkg, cls = package_name(name), class_name(name)
    _check(name, out, pkg)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for src in sorted(TEMPLATE.rglob("*")):
            rel = src.relative_to(TEMPLATE)
            if any(part in _SKIP or part.endswith(".egg-info") for part in rel.parts) or src.suffix == ".pyc":
                continue
            dest = staging / _replace(rel.as_posix(), name, pkg, cls)
            if src.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_replace(src.read_text(encoding="utf-8"), name, pkg, cls), encoding="utf-8")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(staging, 0o777 & ~mask)  # as a plain mkdir would (mkdtemp makes it 0o700)
        if out.is_dir():
            out.rmdir()  # empty (checked); a folder made meanwhile makes this fail: nothing is lost
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return NewTask(name=name, package=pkg, cls=cls, out=out)
