"""Network addresses as the daemons and the CLI write them: ``HOST:PORT`` or ``[V6]:PORT``."""

from __future__ import annotations


def split_hostport(address: str) -> tuple[str, int]:
    """``'host:port'`` or ``'[v6]:port'`` -> (host, port). Raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def with_port(listen: str, port: int) -> str:
    """Replace the port of ``listen`` (e.g. ``127.0.0.1:0`` -> ``127.0.0.1:43121``)."""
    host, _ = split_hostport(listen)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"
