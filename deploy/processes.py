"""The process plumbing of a trial on one machine (:mod:`deploy.local_trial`, the studies): the
console scripts of this environment, free loopback ports, the open-files limit, and the prefix
that stops a child when its launcher dies."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

__all__ = ["BIN", "tool", "free_port", "free_ports", "raise_open_files_limit", "die_with_parent"]

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a console script of this environment (``peer``, ``coordinator``), else its name
    (found on PATH)."""
    path = BIN / name
    return str(path) if path.exists() else name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (all held open while they are picked, so the
    kernel cannot hand one out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def raise_open_files_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (the daemons inherit it):
    a coordinator of 100 sites holds a connection to and from every site."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def die_with_parent() -> list[str]:
    """A command prefix that gives the child SIGTERM if the launcher dies, even by SIGKILL
    (Linux ``setpriv --pdeathsig``; nothing where setpriv is missing). Not a ``preexec_fn``:
    Python code between fork and exec runs grpc's fork handlers in the child, which can abort
    it ("epoll_wait error: Bad file descriptor")."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv else []
