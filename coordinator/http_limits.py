"""The live run page's own limits: connections, request heads, keep-alive, ``Host:``, quiet logs.

The page (``coordinator/web``) is plain HTTP without authentication, so anyone who reaches its
address may connect. The hostile trial held 1,100 half-sent requests open (uvicorn waits for a
request head without a deadline) until the coordinator ran out of file descriptors, and uvicorn
logged 223,000 tracebacks; a page that answers any ``Host:`` header can be read by a web site
through DNS rebinding. This module bounds all of it:

- :class:`HttpLimits`: at most ``max_connections`` connections at once (a connection over it
  is closed at once, before anything is read; long-lived event streams count), a request's
  head (request line and headers) must arrive within ``head_timeout`` seconds and be at most
  ``max_head_bytes`` bytes, an idle keep-alive connection is closed after ``keep_alive`` seconds.
  :func:`bounded_protocol` is uvicorn's h11 protocol with these bounds.
- :class:`HostCheck`: ASGI middleware answering 400 to a request whose ``Host:`` is neither an IP
  address literal (a browser that sent one has no other site's name to rebind), a localhost
  name, nor a name the operator allowed (``coordinator serve --web-host NAME``).
  (Starlette's ``TrustedHostMiddleware`` splits the header at the first ``:`` and so cannot
  accept ``[::1]:8070``; it also cannot accept every IP literal.)

Log lines stay quiet under a flood: ``fedrelay.limits.quiet_logs`` on uvicorn's and asyncio's
loggers (no traceback per connection, a summary of what was suppressed).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("fedrelay.coordinator.web")

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of one HTTP listener (counts; seconds; bytes). The defaults suit a page read by a
    few operators: 64 connections (event streams included), 10 s for a request head of at most
    16 KiB, 5 s of keep-alive."""

    max_connections: int = 64
    head_timeout: float = 10.0
    max_head_bytes: int = 16 << 10
    keep_alive: float = 5.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not self.head_timeout > 0 or self.max_head_bytes < 1024 \
                or not self.keep_alive > 0:
            raise ValueError(f"HTTP limits must be positive (max_head_bytes >= 1024): {self}")

    def uvicorn_options(self) -> dict:
        """The ``uvicorn.Config`` keywords of these limits (with :func:`bounded_protocol`)."""
        # uvicorn's own ``limit_concurrency`` is left off: it answers 503 to every request once
        # ``max_connections`` are open (it counts the connection asking too), and it reads the
        # request first; :func:`bounded_protocol` closes the connection over the bound instead.
        return {"http": bounded_protocol(self), "timeout_keep_alive": self.keep_alive,
                "h11_max_incomplete_event_size": self.max_head_bytes, "backlog": min(2048, 4 * self.max_connections)}


class _Counts:
    """Connections refused and heads timed out (for tests), and the time of the last log line
    about them: at most one a minute."""

    def __init__(self):
        self.refused = 0
        self.head_timeouts = 0
        self._logged = None

    def note(self, max_connections: int) -> None:
        now = time.monotonic()
        if self._logged is None or now - self._logged >= 60.0:
            self._logged = now
            log.warning("the live run page has %d connections open (its bound): closing new ones at once "
                        "(%d so far, %d half-sent requests closed)", max_connections, self.refused,
                        self.head_timeouts)


def bounded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits``: a connection over ``max_connections`` is closed
    as soon as it is made (uvicorn's own ``limit_concurrency`` reads the request first, holding
    the socket), and one whose request head has not arrived ``head_timeout`` seconds after the
    connection was made or after the previous response is closed. The class's ``counts`` holds
    ``refused`` and ``head_timeouts``."""

    class BoundedH11Protocol(H11Protocol):
        counts = _Counts()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                BoundedH11Protocol.counts.refused += 1
                BoundedH11Protocol.counts.note(limits.max_connections)
                self.transport = transport
                transport.abort()  # nothing read, nothing logged; the socket is closed now
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            if getattr(self, "flow", None) is None:  # refused in connection_made: never counted
                return
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        # -- the head deadline ------------------------------------------------------------------------
        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(limits.head_timeout, self._head_timeout, self.cycle)

        def _cancel_head_timer(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timeout(self, armed_cycle) -> None:
            self._head_timer = None
            if self.cycle is not armed_cycle:
                return  # a request began since the timer was armed: its head arrived
            if self.cycle is not None and not self.cycle.response_complete:
                return  # still answering (an event stream): not waiting for a head
            if not self.transport.is_closing():
                BoundedH11Protocol.counts.head_timeouts += 1
                self.transport.abort()

    return BoundedH11Protocol


def allowed_hosts(listen_host: str, extra: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """The host names a request's ``Host:`` may carry (lower case, no port) besides any IP
    literal: the listen host, the localhost names and the operator's ``extra`` names. Raises
    ``ValueError`` for an extra name that is empty or holds a ``:``, ``/`` or space."""
    names = set(LOCAL_NAMES) | {listen_host.strip("[]").lower()}
    for name in extra:
        n = name.strip().lower().rstrip(".")
        if not n or any(c in n for c in ":/ \t@"):
            raise ValueError(f"--web-host {name!r}: expected a host name (e.g. coordinator.example.org)")
        names.add(n)
    return frozenset(names)


def host_of(header: str) -> str | None:
    """The host of a ``Host:`` header value, lower case, without the port (``[::1]:80`` -> ``::1``);
    None when malformed."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not value[end + 1:].startswith(":")):
            return None
        return value[1:end]
    host, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return host.rstrip(".") or None


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """Whether a ``Host:`` header value is an IP literal or one of ``names``."""
    host = host_of(header)
    if host is None:
        return False
    if host in names:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheck:
    """ASGI middleware: a request whose ``Host:`` is not allowed (:func:`host_allowed`) is answered
    400 "Invalid host header" without reaching the app (DNS rebinding)."""

    def __init__(self, app, names: frozenset[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if not host_allowed(host, self.names):
                if scope["type"] == "websocket":  # the page has none; refuse before accepting
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
                await send({"type": "http.response.body", "body": b"Invalid host header"})
                return
        await self.app(scope, receive, send)
