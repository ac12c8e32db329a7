"""Keep an authenticated client from starving a daemon, and keep the logs quiet under attack.

gRPC's sync server runs every call on a worker thread of one pool, and takes that thread as
soon as the call starts: a unary call whose request never arrives holds it until the client
gives up (measured with grpcio 1.85: 3 such calls held 3 of 4 workers), and a stream holds it
while it lasts. :class:`Guard` is a ``grpc.ServerInterceptor`` (``fedrelay.server.make_server`` installs
one on every server) that wraps every method:

- **Bounds on calls in flight** (:class:`Limits`), counted per caller identity (the certificate
  name) and per (identity, method). A site may hold ``per_caller`` calls at once, at most
  ``per_method`` of one method (``method_bounds`` overrides: ``Peer.Handoff`` may use the
  caller's whole share), and all sites together at most ``shared`` calls. The ``coordinator``
  and operator identities (``privileged``, and every ``operator.NAME``) may hold ``privileged_per_caller`` calls each,
  ``privileged_total`` together, outside the sites' share. The numbers add up to fewer than the
  pool's workers: admitted calls never fill the pool, and a refusal never waits for a worker.
  A call over a bound is refused at once: RESOURCE_EXHAUSTED.
- **Connections per identity**: a site identity may make calls on at most
  ``per_identity_connections`` connections within the idle window
  (``fedrelay.limits.IdentityConnections``); a call on one more is refused (RESOURCE_EXHAUSTED).
- **A deadline for the first request message** (``first_message_timeout`` seconds): the request
  of a unary call, the first message of a stream (a handoff's header). A call that sends none in
  time is refused (DEADLINE_EXCEEDED) and its worker freed. (Unary methods are served as
  client-stream methods to get there: the handler runs at once, checks the bounds, then waits
  for the request with that deadline; on the wire nothing changes.)
- **Malformed messages** (a request that does not parse) are refused with INVALID_ARGUMENT,
  without gRPC's traceback: the deserializer no longer raises inside gRPC.
- **Names**: a :class:`fedrelay.names.InvalidName` raised by a servicer method is answered with
  INVALID_ARGUMENT.
- **One log line per refused call** (any call a handler ended with an error status), naming
  the caller, the method, the reason and the caller's address (``context.peer()``), at most ``log_lines`` lines per caller per
  ``log_window`` seconds; the lines over that are counted and summed up in one line ("suppressed
  K refusal lines ...") once the window is over (written with the caller's next refusal or the
  next refusal of anyone, or by :meth:`RefusalLog.flush`).

- **Revoked certificates** (``revocations``, a :class:`fedrelay.revocation.RevocationList`): a
  call whose client certificate's serial is on the federation's revocation list is refused
  (PERMISSION_DENIED, saying who revoked it and when), before any bound is counted; when a new
  list revokes a certificate, the calls it has in flight are cancelled (a revoked site's running
  transfers and control stream stop at once).

On a plaintext server (``--insecure``) there are no identities: the per-caller bounds do not
apply (only ``shared``, the deadline and the rest); the log names the caller's address.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from fedrelay import limits as limits_mod
from fedrelay import names
from fedrelay.callers import COORDINATOR_IDENTITY, OPERATOR_IDENTITY, caller_identity, is_operator

log = logging.getLogger("fedrelay.guard")

HANDOFF_METHOD = "/fedrelay.v1.Peer/Handoff"
DETAILS_SHOWN = 300  # characters of a refusal's details written to the log


@dataclass
class Limits:
    """The numbers a :class:`Guard` enforces (counts are calls in flight; times in seconds).

    The default: 128 workers; a site holds at most 8 calls (4 of one method, 8 handoffs), the
    sites together 80; ``coordinator`` and ``operator`` 16 each, 32 together; so at most 112
    calls are admitted and 16 workers stay free for refusals.
    """

    max_workers: int = 128
    per_caller: int = 8
    per_method: int = 4
    method_bounds: dict[str, int] = field(default_factory=lambda: {HANDOFF_METHOD: 8})
    shared: int = 80
    privileged: frozenset[str] = frozenset({COORDINATOR_IDENTITY, OPERATOR_IDENTITY})
    privileged_per_caller: int = 16
    privileged_total: int = 32
    first_message_timeout: float = 10.0
    # Long-lived calls (the control streams of sites that connect out only: one per such site,
    # open for the daemon's life) count against their caller's bounds but not ``shared``; the
    # server then needs a worker thread per stream on top of ``max_workers``' others.
    long_lived: frozenset[str] = frozenset()
    log_lines: int = 10
    log_window: float = 60.0
    # Connections one site identity may make calls on within the idle window
    # (``fedrelay.limits.IdentityConnections``; the privileged identities are not bounded).
    per_identity_connections: int = 64

    def __post_init__(self) -> None:
        if self.shared + self.privileged_total > self.max_workers:
            raise ValueError(f"shared ({self.shared}) + privileged_total ({self.privileged_total}) calls must "
                             f"fit in max_workers ({self.max_workers})")


class RefusalLog:
    """Rate-limited refusal lines: at most ``lines`` per caller per ``window`` seconds, then one
    summary line per caller and window with the number suppressed. Thread-safe."""

    def __init__(self, logger: logging.Logger = log, lines: int = 10, window: float = 60.0, clock=time.monotonic):
        self.logger, self.lines, self.window, self.clock = logger, lines, window, clock
        self._lock = threading.Lock()
        self._windows: dict[str, list] = {}  # caller -> [window start, lines written, lines suppressed]

    def refused(self, caller: str, method: str, reason: str, address: str = "") -> None:
        """Write ``refused METHOD from CALLER: REASON (peer ADDRESS)`` unless this caller's window
        is full (``address``: gRPC's ``context.peer()``, e.g. ``ipv4:10.0.0.5:41234``)."""
        now = self.clock()
        with self._lock:
            summaries = self._expired(now)
            w = self._windows.setdefault(caller, [now, 0, 0])
            write = w[1] < self.lines
            w[1 if write else 2] += 1
        for line in summaries:
            self.logger.warning(line)
        if write:
            self.logger.warning("refused %s from %s: %s%s", method, caller, reason,
                                f" (peer {address})" if address else "")

    def flush(self, force: bool = False) -> None:
        """Write the summaries of the windows that are over (every window when ``force``)."""
        with self._lock:
            summaries = self._expired(float("inf") if force else self.clock())
        for line in summaries:
            self.logger.warning(line)

    def _expired(self, now: float) -> list[str]:
        out = []
        for caller, (start, _, suppressed) in list(self._windows.items()):
            if now >= start + self.window:
                del self._windows[caller]
                if suppressed:
                    out.append(f"suppressed {suppressed} refusal lines for {caller} "
                               f"(more than {self.lines} in {self.window:g} s)")
        return out


class _Malformed:
    """What the guard's deserializer returns for bytes that do not parse (instead of raising)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class MalformedMessage(Exception):
    """Raised from a guarded request iterator at a message that did not parse."""


_END = object()  # a stream that ended before its first message


class _Slot:
    """One admitted call of the caller ``label``: released once (the handler returned, or the
    call ended)."""

    __slots__ = ("guard", "keys", "label", "released", "serial", "context")

    def __init__(self, guard: "Guard", keys: tuple, label: str, serial: int | None = None, context=None):
        self.guard, self.keys, self.label, self.released = guard, keys, label, False
        self.serial, self.context = serial, context

    def release(self) -> None:
        with self.guard._lock:
            if self.released:
                return
            self.released = True
            if self.serial is not None:
                live = self.guard._live.get(self.serial)
                if live is not None:
                    live.discard(self)
                    if not live:
                        del self.guard._live[self.serial]
            for key in self.keys:
                self.guard._counts[key] -= 1
                if not self.guard._counts[key]:
                    del self.guard._counts[key]


def _short(method: str) -> str:
    """``/fedrelay.v1.Peer/Handoff`` -> ``Peer.Handoff``."""
    service, _, name = method.rpartition("/")
    return f"{service.rpartition('.')[2]}.{name}" if service else method


def _clean(text: str) -> str:
    """Details for one log line: no control characters, at most ``DETAILS_SHOWN`` characters."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:DETAILS_SHOWN + 1])
    return text[:DETAILS_SHOWN] + ("..." if len(text) > DETAILS_SHOWN else "")


class Guard(grpc.ServerInterceptor):
    """The server interceptor described in the module docstring. ``limits`` may be changed on a
    running guard (tests shorten ``first_message_timeout``); counts in flight are in ``counts()``.
    ``on_refusal(method, code)`` is called for every refused call (``Peer.Handoff``, a
    ``grpc.StatusCode``), also those whose log line the rate limit suppresses: the daemons'
    metrics count refusals with it."""

    def __init__(self, limits: Limits | None = None, on_refusal=None, revocations=None):
        self.limits = limits or Limits()
        self.on_refusal = on_refusal
        self._live: dict[int, set] = {}  # certificate serial -> its admitted calls in flight (_Slot)
        self.revocations = None
        if revocations is not None:
            self.watch(revocations)
        self.refusals = RefusalLog(log, self.limits.log_lines, self.limits.log_window)
        self._lock = threading.Lock()
        self._counts: dict[tuple, int] = {}
        self._cache: dict[str, tuple] = {}
        self.connections = limits_mod.IdentityConnections(self.limits.per_identity_connections,
                                                          window=limits_mod.MAX_CONNECTION_IDLE_MS / 1000,
                                                          exempt=self.limits.privileged)
        # Reads of first messages (each waits at most first_message_timeout, and only admitted
        # calls read, so it never runs out of threads).
        self._readers = futures.ThreadPoolExecutor(max_workers=self.limits.max_workers,
                                                   thread_name_prefix="guard-first-message")

    def watch(self, revocations) -> None:
        """Enforce ``revocations`` (a ``fedrelay.revocation.RevocationList``): refuse revoked
        callers, and cancel the calls in flight of every certificate a new list revokes."""
        self.revocations = revocations
        revocations.on_change.append(self.cancel_revoked)

    def cancel_revoked(self, _new=None) -> int:
        """Cancel the calls in flight whose caller's certificate is revoked now; returns how many."""
        if self.revocations is None:
            return 0
        revoked = self.revocations.serials
        with self._lock:
            doomed = [slot for serial, slots in self._live.items() if serial in revoked for slot in slots]
        for slot in doomed:
            log.warning("cancelled a call in flight of %s: its certificate was revoked", slot.label)
            try:
                slot.context.cancel()
            except Exception:  # noqa: BLE001 - a call that ended meanwhile
                pass
        return len(doomed)

    def counts(self) -> dict[tuple, int]:
        """Calls in flight: ``("caller", ID)``, ``("method", ID, METHOD)``, ``("shared",)``,
        ``("privileged",)`` -> count (a snapshot)."""
        with self._lock:
            return dict(self._counts)

    # -- the interceptor ---------------------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._cache[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        """The guarded handler of ``method``: always a client-stream one (see the module
        docstring), around the servicer's ``handler``."""
        parse = handler.request_deserializer

        def deserializer(raw: bytes):
            try:
                return parse(raw)
            except Exception as exc:  # noqa: BLE001 - any parser error is a malformed message
                return _Malformed(exc)

        if handler.request_streaming and handler.response_streaming:
            inner, kind = handler.stream_stream, "stream"
        elif handler.request_streaming:
            inner, kind = handler.stream_unary, "stream"
        elif handler.response_streaming:
            inner, kind = handler.unary_stream, "unary"
        else:
            inner, kind = handler.unary_unary, "unary"

        def argument(request_iterator, context, slot):
            first = self._first_message(request_iterator, context, method, slot)
            if kind == "unary":
                if first is _END:
                    self._refuse(context, slot.label, method, grpc.StatusCode.INVALID_ARGUMENT,
                                 "expected one request message, got none")
                return first
            return self._rest(first, request_iterator)

        @contextlib.contextmanager
        def admitted(request_iterator, context):
            """One call: admitted (or refused), its argument read, what the servicer raises
            answered (:meth:`_after`), its slot released at the end."""
            slot = self._admit(context, method)
            try:
                arg = argument(request_iterator, context, slot)
                try:
                    yield arg
                except Exception as exc:  # noqa: BLE001 - refusals are logged, the rest re-raised
                    self._after(exc, context, slot, method)
            finally:
                slot.release()

        if handler.response_streaming:
            def behaviour(request_iterator, context):
                with admitted(request_iterator, context) as arg:
                    yield from inner(arg, context)

            return grpc.stream_stream_rpc_method_handler(behaviour, deserializer if parse else None,
                                                     handler.response_serializer)

        def behaviour(request_iterator, context):  # noqa: F811 - one of the two is used
            with admitted(request_iterator, context) as arg:
                return inner(arg, context)

        return grpc.stream_unary_rpc_method_handler(behaviour, deserializer if parse else None,
                                                     handler.response_serializer)

    # -- the pieces ----------------------------------------------------------------------------------
    def _caller(self, context) -> tuple[str | None, str]:
        """(identity or None on a plaintext server, label for the log)."""
        who = caller_identity(context)
        if who is None:  # plaintext: the caller's host ("ipv4:10.0.0.5"; the port changes per connection)
            return None, context.peer().rpartition(":")[0] or context.peer()
        return who, repr(who)

    def _admit(self, context, method: str) -> _Slot:
        """Count the call in, or refuse it (RESOURCE_EXHAUSTED) when it is over a bound."""
        who, label = self._caller(context)
        serial = None
        if who is not None and self.revocations is not None:
            pem = (context.auth_context() or {}).get("x509_pem_cert") or []
            if pem:
                refused = self.revocations.refused(pem[0])
                if refused:
                    self._refuse(context, label, method, grpc.StatusCode.PERMISSION_DENIED, refused)
                serial = self.revocations.serial_for(pem[0])
        lim = self.limits
        if who is not None and (who in lim.privileged or is_operator(who)):
            bounds = [(("caller", who), lim.privileged_per_caller, "this identity"),
                      (("privileged",), lim.privileged_total, "the coordinator and operator together")]
        elif who is not None:
            bounds = [(("method", who, method), lim.method_bounds.get(method, lim.per_method),
                       f"this identity's {_short(method)} calls"),
                      (("caller", who), lim.per_caller, "this identity")]
            if method not in lim.long_lived:
                bounds.append((("shared",), lim.shared, "all sites together"))
        else:  # plaintext: no identities
            bounds = [(("shared",), lim.shared, "all callers together")]
        if who is not None and not self.connections.admit(who, context.peer()):
            self._refuse(context, label, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"too many connections: this identity may make calls on {self.connections.per_identity} "
                         "connections at once; reuse a channel")
        with self._lock:
            over = next(((limit, what) for key, limit, what in bounds if self._counts.get(key, 0) >= limit), None)
            if over is None:
                for key, _, _ in bounds:
                    self._counts[key] = self._counts.get(key, 0) + 1
        if over is not None:
            self._refuse(context, label, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"too many calls in flight: {over[1]} may hold {over[0]} at once; retry later")
        slot = _Slot(self, tuple(key for key, _, _ in bounds), label, serial, context)
        if serial is not None:
            with self._lock:
                self._live.setdefault(serial, set()).add(slot)
        context.add_callback(slot.release)  # also when a streamed response is abandoned
        if serial is not None and self.revocations.is_revoked(serial):  # revoked while it was admitted
            slot.release()
            self._refuse(context, label, method, grpc.StatusCode.PERMISSION_DENIED,
                         self.revocations.refused(pem[0]) or "this certificate was revoked")
        return slot

    def _first_message(self, request_iterator, context, method: str, slot):
        """The first request message, or ``_END`` when the stream ended without one. Refuses
        the call (DEADLINE_EXCEEDED) when none comes within ``first_message_timeout`` seconds,
        and (INVALID_ARGUMENT) when it does not parse."""
        timeout = self.limits.first_message_timeout
        pending = self._readers.submit(next, request_iterator, _END)
        try:
            first = pending.result(timeout=timeout)
        except futures.TimeoutError:
            self._refuse(context, slot.label, method, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no request message within {timeout:g} s")
        if isinstance(first, _Malformed):
            self._refuse(context, slot.label, method, grpc.StatusCode.INVALID_ARGUMENT,
                         f"malformed request message: {first.error}")
        return first

    @staticmethod
    def _rest(first, request_iterator):
        """The stream again from its first message; raises ``MalformedMessage`` at a message
        that did not parse."""
        if first is _END:
            return
        yield first
        for msg in request_iterator:
            if isinstance(msg, _Malformed):
                raise MalformedMessage(f"malformed request message: {msg.error}")
            yield msg

    def _after(self, exc: Exception, context, slot, method: str) -> None:
        """A handler raised ``exc``: answer a name or parse error with INVALID_ARGUMENT, log a
        refusal (the handler aborted with a status), re-raise anything else."""
        if isinstance(exc, (names.InvalidName, MalformedMessage)):
            self._refuse(context, slot.label, method, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            details = context.details()
            details = details.decode("utf-8", "replace") if isinstance(details, bytes) else (details or "")
            self._note(context, slot.label, method, code, details)
        raise exc

    def _refuse(self, context, label: str, method: str, code: grpc.StatusCode, details: str) -> None:
        """Log one (rate-limited) line for the caller ``label`` and end the call with ``code``
        and ``details`` (raises, as ``context.abort`` does)."""
        self._note(context, label, method, code, details)
        context.abort(code, details)

    def _note(self, context, label: str, method: str, code: grpc.StatusCode, details: str) -> None:
        """Count a refused call (``on_refusal``) and write its rate-limited log line."""
        if self.on_refusal is not None:
            try:
                self.on_refusal(_short(method), code)
            except Exception:  # noqa: BLE001 - a metrics error must not change the answer
                log.exception("counting a refusal failed")
        self.refusals.refused(label, _short(method), f"{code.name}: {_clean(details)}", context.peer())
