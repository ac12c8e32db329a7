"""Workers forked from a template process (``peer serve --fork-workers``).

By default each worker is a fresh ``python -m fedrelay.peer.worker_main`` (``peer/worker_pool.py``): it
imports torch and pays the first optimiser's one-time cost before it can work, about 3 s of CPU
per job. With ``--fork-workers`` the daemon keeps a template process that has imported them once:
the standard library's ``multiprocessing`` fork server, with torch and the worker's modules
preloaded, started (by exec, not fork: the daemon has gRPC threads) with the daemon's first
worker, the start-up check of its data.
Each worker is then forked from it and starts in a few milliseconds. The template imports torch
and runs nothing, so no torch thread pool or CUDA context is ever forked; each worker still
sets up its device (``prepare``) itself.

The price is memory: the template holds torch's import (and scikit-learn's metrics) for as long
as the daemon runs, about 810 MB resident (measured with scikit-learn on 2026-11-27; 680 MB
without it: 368 MB anonymous, 288 MB of torch's libraries, which the kernel can drop and read
again), where a daemon without it stays under 90 MB while idle; and one more
small process, ``multiprocessing``'s resource tracker (13 MB). So it is for sites that run many
short jobs on a host with memory to spare (test suites, rehearsals with a few sites); a 100-site
trial on one machine leaves it off. The worker runs ``multiprocessing``'s child set-up, which
imports the daemon's main module under the name ``__mp_main__``: ``peer serve`` and a script
that starts ``fedrelay.peer.daemon.serve`` under ``if __name__ == "__main__":`` are safe.

``ForkedProcess`` has the face of the ``subprocess.Popen`` a ``WorkerProcess`` uses otherwise:
text ``stdin``/``stdout``/``stderr`` pipes, ``pid``, ``poll()``, ``wait(timeout)``,
``terminate()``, ``kill()``; its return code is negative for a signal, as ``Popen``'s is.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
from multiprocessing.reduction import DupFd

__all__ = ["ForkedProcess", "PRELOAD"]

# What the template imports once, so that no worker has to: torch, torch._dynamo (which the
# first optimiser step imports: ~1 s), scikit-learn's metrics (which every evaluation imports,
# fedrelay/scoring.py: ~1.3 s of CPU, more than a test's training job), and the worker's own modules.
# Task modules are not preloaded: a worker imports the run's task itself, after checking its code's
# digest (a template that had imported it would keep the code of the daemon's start).
PRELOAD = ["torch", "torch._dynamo", "sklearn.metrics", "fedrelay.peer.training", "fedrelay.peer.jobs", "fedrelay.peer.worker_main"]

_context = None
_context_lock = threading.Lock()


def _fork_server():
    """The process-wide fork-server context, its preload set once."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


class _Fd:
    """A file descriptor handed to the forked worker (sent over the fork server's socket with
    ``SCM_RIGHTS``, as ``multiprocessing`` sends a ``Connection``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _rebuild_fd, (DupFd(self.fd),)


def _rebuild_fd(dup) -> _Fd:
    return _Fd(dup.detach())


def _child(stdin: _Fd, stdout: _Fd, stderr: _Fd, env: dict | None) -> None:
    """The forked worker: the three pipes become its fd 0, 1 and 2, then ``worker_main.main``."""
    import sys

    from fedrelay.peer import worker_main

    for fd, target in ((stdin.fd, 0), (stdout.fd, 1), (stderr.fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    sys.exit(worker_main.main())


class ForkedProcess:
    """One worker forked from the template (see the module docstring). ``env``: the worker's
    environment [default: the daemon's when the template started]. Raises ``OSError`` when the
    fork server cannot be started or reached."""

    def __init__(self, env: dict | None = None):
        pipes = [os.pipe() for _ in range(3)]  # (read, write) for stdin, stdout, stderr
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:
            self._proc = _fork_server().Process(target=_child, args=(*map(_Fd, theirs), env), daemon=True,
                                                name="fedrelay-worker")
            self._proc.start()
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)  # the worker holds its own copies
        self.stdin = open(ours[0], "w", buffering=1)
        self.stdout = open(ours[1])
        self.stderr = open(ours[2])

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The return code, once the worker has ended. Raises ``subprocess.TimeoutExpired``."""
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("fedrelay-worker", timeout)
        return code

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()
