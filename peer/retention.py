"""Retention: remove the files of ended runs from a site's state dir (``peer prune``).

A run folder (``<state-dir>/runs/<run_id>/``, see :mod:`fedrelay.peer.runs`) may go once the run
has ended: the coordinator's end notice (``Peer.EndRun``) recorded its status (finished, failed
or cancelled) and time in ``state.json`` (``run_status``, ``run_ended``), or the site's own state
is terminal for good (``ended``: the coordinator ended it; ``failed``: a failure here fails the
run). A run that is ``done`` here but has had no end notice may still be running elsewhere (its
final model is evaluated here, a reroute may resend its model): it is kept. The age of a run is
counted from ``run_ended``, else from the last change of its ``state.json``.

Safe while the daemon runs: only ended runs are touched, and the daemon writes nothing more
into their folders (it only reads a final model for ``fetch-model``, which then fails cleanly).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

ENDED_STATUSES = ("finished", "failed", "cancelled")
ENDED_STATES = ("ended", "failed")  # the site's own terminal states that end the run
DAY = 86_400.0  # seconds


@dataclass
class RunFolder:
    """One run folder of a state dir: its id, the run's status (``finished``, ``failed``,
    ``cancelled``; ``ended`` for an older folder whose notice was not recorded; ``running`` when
    not known to have ended), when it ended or last changed
    (unix seconds), its size in bytes, and whether it is pruned."""
    run_id: str
    folder: Path
    status: str
    since: float
    bytes: int
    pruned: bool = False


def _status(folder: Path) -> tuple[str, float]:
    """(status, since) of the run in ``folder``; ("running", mtime) when not known to be over."""
    state = folder / "state.json"
    try:
        doc = json.loads(state.read_text())
        mtime = state.stat().st_mtime
    except (OSError, ValueError):
        return "running", time.time()  # unreadable: never pruned
    if doc.get("run_status") in ENDED_STATUSES:
        return doc["run_status"], float(doc.get("run_ended") or mtime)
    if doc.get("state") in ENDED_STATES:  # a folder written before end notices were recorded
        return doc["state"], mtime
    return "running", mtime


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def prune(state_dir: Path, older_than_days: float, *, dry_run: bool = False,
          now: float | None = None) -> list[RunFolder]:
    """Remove the folders of runs under ``state_dir/runs`` that ended more than
    ``older_than_days`` days ago (see the module docstring); ``dry_run``: remove nothing.

    Returns every run folder found, oldest first, ``pruned`` True for those removed (or that
    would be, with ``dry_run``). Raises ``ValueError`` for a negative age or a ``state_dir``
    that holds no ``runs`` folder, ``OSError`` when a folder cannot be removed.
    """
    if older_than_days < 0:
        raise ValueError(f"--older-than must be >= 0 days, not {older_than_days}")
    runs = Path(state_dir) / "runs"
    if not runs.is_dir():
        raise ValueError(f"{state_dir} is not a peer's state dir (it has no runs/ folder)")
    now = time.time() if now is None else now
    found = []
    for folder in sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()):
        status, since = _status(folder)
        entry = RunFolder(folder.name, folder, status, since, _size(folder))
        entry.pruned = status != "running" and now - since > older_than_days * DAY
        if entry.pruned and not dry_run:
            shutil.rmtree(folder)
        found.append(entry)
    return sorted(found, key=lambda r: r.since)
