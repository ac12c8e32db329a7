"""Host-wide worker slots: at most N training/evaluation worker
processes at once on one machine, shared by every site daemon there.

A slot is a file ``slot-<i>`` in a folder (default ``/tmp/fedrelay-worker-slots-<uid>``) held
with an exclusive ``fcntl.flock``. The lock belongs to the open file, so it is released when the
holder closes it or its process dies in any way (SIGKILL and out-of-memory kills included):
a crashed daemon never leaks a slot. Daemons need not agree on anything but the folder; a
daemon started with a smaller N uses only the first N files.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

__all__ = ["DEFAULT_SLOTS", "Slot", "HostSlots", "default_folder"]

DEFAULT_SLOTS = 3


ENV_FOLDER = "FEDRELAY_WORKER_SLOTS_DIR"


def default_folder() -> Path:
    """``$FEDRELAY_WORKER_SLOTS_DIR`` when set (e.g. one set of slots per trial: the daemons of
    ``deploy/local_trial.py``), else ``/tmp/fedrelay-worker-slots-<uid>``: one set of slots per
    user on the machine."""
    if os.environ.get(ENV_FOLDER):
        return Path(os.environ[ENV_FOLDER])
    return Path("/tmp") / f"fedrelay-worker-slots-{os.getuid()}"


class Slot:
    """One held slot (``index`` of ``HostSlots.count``); ``release()`` (idempotent) frees it."""

    def __init__(self, index: int, fd: int):
        self.index, self._fd = index, fd

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the file drops its flock

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class HostSlots:
    """``count`` slots in ``folder`` (made if needed, mode 0700). Raises ``ValueError`` for
    ``count`` < 1 or a folder that cannot be made."""

    def __init__(self, count: int = DEFAULT_SLOTS, folder: str | Path | None = None):
        if count < 1:
            raise ValueError(f"worker slots must be >= 1, not {count}")
        self.count = count
        self.folder = Path(folder) if folder is not None else default_folder()
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot make the worker-slot folder {self.folder}: {exc.strerror or exc}") from None

    def try_acquire(self) -> Slot | None:
        """A free slot, or None when all ``count`` are held (by any process on this host)."""
        for i in range(self.count):
            fd = os.open(self.folder / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return Slot(i, fd)
        return None

    def acquire(self, stop: threading.Event | None = None, poll: float = 0.2,
                timeout: float | None = None) -> Slot | None:
        """Wait for a free slot (polling every ``poll`` seconds). None when ``stop`` is set or
        ``timeout`` seconds passed first."""
        import time

        stop = stop or threading.Event()
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            slot = self.try_acquire()
            if slot is not None:
                return slot
            if until is not None and time.monotonic() >= until:
                return None
            if stop.wait(poll):
                return None

    def held(self) -> int:
        """How many slots are held now (by any process): a probe that takes and drops each free one."""
        busy = 0
        for i in range(self.count):
            fd = os.open(self.folder / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy += 1
            finally:
                os.close(fd)
        return busy
