"""``peer serve --check``: validate a daemon's options the way ``peer serve`` does, then stop
before listening or dialling anyone.

What an administrator runs after editing a site's env file (``deploy/systemd/peer.env.example``,
or the ``peer.env`` of a site kit from ``coordinator enroll --kit``), and what the tests run on
those files parsed the way systemd parses them (``tests/test_deploy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedrelay import names, wire


@dataclass
class CheckResult:
    """What ``--check`` found: the resolved device (``cpu`` or ``cuda:N``), the address other
    sites would dial, and the site's image count (train + test) and class names."""
    device: str
    address: str
    images: int
    classes: list[str]


def check_listen(listen: str) -> None:
    """``HOST:PORT`` with PORT 0-65535 (0: any free port). Raises ``ValueError``."""
    try:
        host, port = wire.split_hostport(listen)
    except ValueError:
        raise ValueError(f"--listen must be HOST:PORT (e.g. 0.0.0.0:50071), not {listen!r}") from None
    if not host or not 0 <= port <= 65535:
        raise ValueError(f"--listen must be HOST:PORT with PORT 0-65535, not {listen!r}")


def check_serve_options(*, data_dir: Path, name: str, listen: str, coordinator: str, state_dir: Path, device: str,
                        transport: wire.Transport, advertise: str | None = None, stall_timeout: float = 60.0,
                        weights_dir: Path | None = None, outbound_only: bool = False,
                        relay_after: float = 60.0) -> CheckResult:
    """Every check ``fedrelay.peer.daemon.serve`` makes before it serves, plus the coordinator's
    address: the name (a DNS label) and that the TLS identity is that name; ``stall_timeout`` > 0;
    the state dir is writable (it is created if missing, as the daemon does); the device exists
    here; the data folder loads (every image is decoded: seconds per 10,000 images) with valid
    class names; listen, advertise and coordinator addresses are ``HOST:PORT``, and a wildcard
    listen address comes with ``--advertise``; ``weights_dir``, when given, is a folder or absent.
    Binds no port and contacts no one.

    Raises ``fedrelay.peer.data.DataError`` (a ``ValueError``) for the data folder and
    ``ValueError`` for everything else, with a message naming the option.
    """
    from fedrelay.peer.daemon import check_outbound, check_state_dir
    from fedrelay.peer.data import load_site
    from fedrelay.peer.worker import resolve_device

    advertise = advertise or None  # "" (an empty FEDRELAY_ADVERTISE): not given
    try:
        names.check_site_name(name, "--name")
        if transport.secure and transport.identity != name:
            raise ValueError(f"--tls {transport.source} holds the identity {transport.identity!r}, not --name {name!r}")
        if stall_timeout <= 0:
            raise ValueError("--stall-timeout must be > 0 seconds")
        check_listen(listen)
        check_outbound(outbound_only, advertise, transport, relay_after)
        if advertise is not None:
            names.check_address(advertise, "--advertise")
        host, _ = wire.split_hostport(advertise or listen)
        if host in ("0.0.0.0", "::") and not outbound_only:
            raise ValueError(f"listening on {listen}: pass --advertise HOST:PORT, the address other sites can reach")
        names.check_address(coordinator, "--coordinator")
        if weights_dir is not None and weights_dir.exists() and not weights_dir.is_dir():
            raise ValueError(f"--weights-dir {weights_dir} is not a folder")
    except names.InvalidName as exc:
        raise ValueError(str(exc)) from None
    check_state_dir(Path(state_dir))
    resolved = resolve_device(device)
    data = load_site(data_dir)
    try:
        names.check_class_names(data.class_names, f"the class folders of {data_dir}")
    except names.InvalidName as exc:
        raise ValueError(str(exc)) from None
    images = sum(data.train_counts.values()) + sum(data.test_counts.values())
    return CheckResult(device=resolved, address="" if outbound_only else advertise or listen, images=images,
                       classes=list(data.class_names))
