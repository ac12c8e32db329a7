"""The gRPC server of both daemons: bound, guarded, bounded.

:func:`make_server` makes every server of both daemons: mutual TLS when its
``fedrelay.transport.Transport`` is secure, a ``fedrelay.guard.Guard`` on every call (bounds on
calls in flight per caller, a first-message deadline, clean refusals, quiet logs), and
connection limits (``fedrelay/limits.py``: handshake timeout, idle timeout, streams per
connection, connections per listener).
"""

from __future__ import annotations

import socket
from concurrent import futures

import grpc

from fedrelay import limits
from fedrelay.addresses import split_hostport
from fedrelay.guard import Guard
from fedrelay.transport import CHANNEL_OPTIONS, INSECURE, Transport

SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
    ("grpc.server_handshake_timeout_ms", limits.HANDSHAKE_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", limits.MAX_CONNECTION_IDLE_MS),
    ("grpc.max_concurrent_streams", limits.MAX_STREAMS_PER_CONNECTION),
    # Identity only: no compressed request is accepted (UNIMPLEMENTED), so a few KiB on the wire
    # cannot unpack into a large model stream or report.
    ("grpc.compression_enabled_algorithms_bitset", 1),
]


def make_server(listen: str, transport: Transport = INSECURE, guard=None, *, also: list[str] | tuple[str, ...] = (),
                max_connections: int | None = None) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``listen`` (``HOST:PORT``; port 0 picks a free one), with mutual TLS
    when ``transport`` is secure (daemons always pass theirs; the default is plaintext).

    Every call passes ``guard`` (a ``fedrelay.guard.Guard``; a new one with the default
    ``Limits`` when None): bounds on calls in flight per caller, a deadline for the first
    request message, clean refusals of malformed messages, rate-limited refusal logs. The
    worker pool has ``guard.limits.max_workers`` threads (started as needed). Connections must
    finish their handshake within ``limits.HANDSHAKE_TIMEOUT_MS``, are closed after
    ``limits.MAX_CONNECTION_IDLE_MS`` without a call, and carry at most
    ``limits.MAX_STREAMS_PER_CONNECTION`` calls at once; the process's open-files limit is raised and the listener accepts at most
    ``fedrelay.limits.max_connections`` connections at once (``fedrelay/limits.py``;
    ``max_connections`` overrides it).

    ``also``: more addresses (``HOST:PORT``) the same server listens on, each with a quota of
    connections of its own: the coordinator's operator listener (``--operator-listen``), which
    connections held on ``listen`` cannot fill. ``server.also_ports`` holds their bound ports.

    Returns (server, bound port of ``listen``). Raises ``RuntimeError`` when an address cannot
    be bound.
    """
    guard = guard if guard is not None else Guard()
    check_bindable(listen)
    # Connections are bounded per listener and by the open-files limit (fedrelay/limits.py).
    open_files = limits.raise_open_files()
    connections = max_connections if max_connections is not None else limits.max_connections(open_files)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=guard.limits.max_workers),
                         interceptors=[guard],
                         options=SERVER_OPTIONS + [("grpc.max_allowed_incoming_connections", connections)])
    ports = []
    for address in (listen, *also):
        try:
            if transport.secure:
                port = server.add_secure_port(address, transport.server_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {address}: address in use or not available")
        ports.append(port)
    port = ports[0]
    server.also_ports = ports[1:]
    return server, port


def check_bindable(listen: str) -> None:
    """Raise ``RuntimeError`` (``cannot listen on LISTEN: ...``) when ``listen`` (``HOST:PORT``)
    is malformed, its host does not resolve, or its port is taken or not ours to bind, checked
    with a plain socket before gRPC tries: gRPC's C core would log its own line on stderr first,
    and a daemon would have opened its files. Port 0 (any free port) is not checked. A port taken
    between this check and gRPC's bind still fails, in gRPC's words."""
    try:
        host, port = split_hostport(listen)
    except ValueError:
        raise RuntimeError(f"cannot listen on {listen!r}: expected HOST:PORT") from None
    if port == 0:
        return
    if not 0 < port <= 65535:
        raise RuntimeError(f"cannot listen on {listen}: the port must be 1-65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise RuntimeError(f"cannot listen on {listen}: the host {host!r} does not resolve ({exc})") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise RuntimeError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
