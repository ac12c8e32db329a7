"""Connection bounds of the daemons' gRPC servers, the open-files limit, and quiet logs.

The hostile trial held about 1,000 idle TLS connections to a coordinator from one enrolled site
(no call made): with the usual soft limit of 1,024 open files, the process could not accept the
operator's connection (``ListPeers`` timed out), open its ledger or write a relayed payload.
What bounds that here:

- :func:`raise_open_files`: a daemon raises its soft ``RLIMIT_NOFILE`` to the hard limit (at most
  ``OPEN_FILES_WANTED``) when it starts a server, so that connections are not what runs out.
- :func:`max_connections`: each gRPC listener accepts at most that many connections at once
  (gRPC's ``grpc.max_allowed_incoming_connections``; a connection over it is closed at once),
  half of the open files above a reserve of ``FILES_RESERVED`` for the ledger, payloads, worker
  pipes and the HTTP endpoints, and at most ``MAX_CONNECTIONS``.
- ``MAX_CONNECTION_IDLE_MS``: a connection without a call in flight is closed after that
  long; ``HANDSHAKE_TIMEOUT_MS``: a connection must finish TLS within that long;
  ``MAX_STREAMS_PER_CONNECTION``: calls at once on one connection (``fedrelay.server`` sets all
  three on every server).
- :class:`IdentityConnections`: the connections an identity makes calls on, per identity (the
  certificate name; the client's host on a plaintext server). A call on a new connection of
  an identity that already used ``per_identity`` others within the idle window is refused
  (``RESOURCE_EXHAUSTED``, by ``fedrelay.guard.Guard``): a site needs one connection per channel,
  a handful in all.

A connection that never makes a call is not seen by any code above gRPC's transport (it has no
identity until a call): what bounds it is the handshake timeout, the idle close and the
listener's total. Per source address, before TLS, the firewall bounds it
(``docs/limits.md`` has an nftables rule).

:func:`quiet_logs` keeps a flood from writing a log line (or a traceback) per connection.
"""

from __future__ import annotations

import logging
import threading
import time

OPEN_FILES_WANTED = 65536
FILES_RESERVED = 512
MAX_CONNECTIONS = 4096
MIN_CONNECTIONS = 64
PER_IDENTITY_CONNECTIONS = 32
HANDSHAKE_TIMEOUT_MS = 10_000  # a connection must finish TLS and HTTP/2 set-up within 10 s
MAX_CONNECTION_IDLE_MS = 60_000  # a connection with no call for 1 minute is closed (GOAWAY)
MAX_STREAMS_PER_CONNECTION = 256  # calls at once on one connection (HTTP/2); above the guard's bounds, which do the limiting

log = logging.getLogger("fedrelay.limits")


def raise_open_files(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft open-files limit towards ``wanted`` (never above the hard
    limit, never lowered). Returns the soft limit now in force (``wanted`` where the platform
    has no ``resource`` module)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return wanted if soft == resource.RLIM_INFINITY else soft


def max_connections(open_files: int) -> int:
    """Connections one gRPC listener accepts at once for a process allowed ``open_files`` open
    files: half of what is left above ``FILES_RESERVED``, between ``MIN_CONNECTIONS`` and
    ``MAX_CONNECTIONS``."""
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, (open_files - FILES_RESERVED) // 2))


class IdentityConnections:
    """The connections each identity made calls on, with the time of each one's last call
    (seconds, ``clock``). Thread-safe.

    ``per_identity``: connections one identity may use within ``window`` seconds (a connection
    without a call for ``window`` is closed by the server's idle timeout, so it stops counting
    then). ``exempt``: identities not bounded (the coordinator and the operator)."""

    def __init__(self, per_identity: int = PER_IDENTITY_CONNECTIONS, window: float = 60.0,
                 exempt: frozenset[str] = frozenset(), clock=time.monotonic):
        if per_identity < 1 or not window > 0:
            raise ValueError(f"per_identity must be >= 1 and window > 0 (got {per_identity}, {window})")
        self.per_identity, self.window, self.exempt, self.clock = per_identity, window, exempt, clock
        self._lock = threading.Lock()
        self._seen: dict[str, dict[str, float]] = {}  # identity -> connection (context.peer()) -> last call

    def admit(self, identity: str, connection: str) -> bool:
        """Note a call of ``identity`` on ``connection`` (gRPC's ``context.peer()``, e.g.
        ``ipv4:10.0.0.5:41234``): False when that is a new connection and the identity already
        used ``per_identity`` others within the window."""
        if identity in self.exempt:
            return True
        now = self.clock()
        with self._lock:
            conns = self._seen.setdefault(identity, {})
            if connection not in conns and len(conns) >= self.per_identity:
                for c in [c for c, t in conns.items() if now - t > self.window]:
                    del conns[c]
                if len(conns) >= self.per_identity:
                    return False
            conns[connection] = now
            return True

    def count(self, identity: str) -> int:
        """Connections of ``identity`` used within the window (a snapshot)."""
        now = self.clock()
        with self._lock:
            return sum(1 for t in self._seen.get(identity, {}).values() if now - t <= self.window)


class QuietFilter(logging.Filter):
    """A logging filter that lets at most ``lines`` records through per ``window`` seconds (per
    logger it is attached to), drops the traceback of those it lets through (unless the logger
    is at DEBUG), and writes one line "suppressed N log lines" when the next record after a full
    window passes."""

    def __init__(self, lines: int = 20, window: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.lines, self.window, self.clock = lines, window, clock
        self._lock = threading.Lock()
        self._start, self._passed, self._suppressed = None, 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        with self._lock:
            summary = None
            if self._start is None or now >= self._start + self.window:
                if self._suppressed:
                    summary = self._suppressed
                self._start, self._passed, self._suppressed = now, 0, 0
            if self._passed >= self.lines:
                self._suppressed += 1
                return False
            self._passed += 1
        if record.exc_info and not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})" if exc else record.getMessage()
            record.args, record.exc_info, record.exc_text = None, None, None
        if summary:
            record.msg = f"{record.getMessage()} (and {summary} similar lines suppressed in the last window)"
            record.args = None
        return True


def quiet_logs(names: tuple[str, ...] = ("uvicorn", "uvicorn.error", "asyncio"), lines: int = 20,
               window: float = 60.0) -> None:
    """Attach a :class:`QuietFilter` to each named logger (once per logger)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietFilter) for f in logger.filters):
            logger.addFilter(QuietFilter(lines, window))
