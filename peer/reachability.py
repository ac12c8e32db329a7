"""Whether other sites can reach a peer daemon at the address it registers (``peer serve``).

A site registers ``--advertise`` (or, without it, its ``--listen`` address) with the coordinator,
and its predecessor dials that address. A loopback address (``127.0.0.1``, ``::1``,
``localhost``) reaches only daemons on the same host; a port 0 is chosen anew at every start.
:func:`judge` says what is wrong with an address, so that ``peer serve`` (and ``--check``) warns
for a federation on one host and refuses when the coordinator is elsewhere, instead of serving
at an address nobody else can dial.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from fedrelay.addresses import split_hostport

HOW = ("pass --listen 0.0.0.0:PORT --advertise HOST:PORT (HOST: the name or address other sites dial), "
       "or --outbound-only (TLS: models come through the relay)")


@dataclass(frozen=True)
class Reach:
    """The verdict on a daemon's address: ``problem`` (it cannot work: refuse to serve) or
    ``warnings`` (it works only in a narrower setting than a federation across hosts)."""
    problem: str | None
    warnings: tuple[str, ...]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address, IPv6 with or without brackets) is this host only."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def judge(*, listen: str, advertise: str | None, coordinator: str, outbound_only: bool, chosen: bool = False) -> Reach:
    """The verdict on the address a daemon with these options registers (``advertise`` or
    ``listen``, both ``HOST:PORT``; ``coordinator``: the coordinator's ``HOST:PORT``).

    A site that connects out only registers no address: nothing to judge. A loopback address is
    a problem when the coordinator is not on loopback (the other sites, on other hosts, cannot dial
    it), else a warning (only sites on this host can); a port 0 without ``--advertise`` is a
    warning (a new port at every start: nothing to open in a firewall). ``chosen``: the listen
    address was given (command line, variable, configuration file), not the default; then a
    federation on one host is what was asked for, and only the problem is reported. Never raises
    for a well-formed address; malformed ones are ``fedrelay.names.check_address``'s to refuse."""
    if outbound_only:
        return Reach(None, ())
    address = advertise or listen
    flag = "--advertise" if advertise else "--listen"
    try:
        host, port = split_hostport(address)
        coord_host, _ = split_hostport(coordinator)
    except ValueError:
        return Reach(None, ())
    warnings: list[str] = []
    if is_loopback(host):
        if not is_loopback(coord_host):
            return Reach(f"{flag} {address} is a loopback address: only this host can reach it, and the "
                         f"coordinator at {coordinator} and the other sites are elsewhere; {HOW}", ())
        if not chosen:
            warnings.append(f"{flag} {address} is a loopback address: only sites on this host can reach this peer "
                            f"(fine for a trial on one machine); for a federation across hosts {HOW}")
    if port == 0 and not advertise and not chosen:
        warnings.append(f"--listen {address}: the port is chosen anew at every start (nothing to open in a "
                        "firewall, and a restarted daemon registers another address); pass a fixed port")
    return Reach(None, tuple(warnings))
