"""``peer serve --check``: validate a daemon's options the way ``peer serve`` does, then stop
before listening or dialling anyone.

What an administrator runs after editing a site's env file (``deploy/systemd/peer.env.example``,
or the ``peer.env`` of a site kit from ``coordinator enroll --kit``), and what the tests run on
those files parsed the way systemd parses them (``tests/test_deploy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedrelay import names, tasks as task_registry
from fedrelay.addresses import split_hostport
from fedrelay.transport import Transport
from fedrelay.tasks.offers import Offer


@dataclass
class CheckResult:
    """What ``--check`` found: the resolved device (``cpu`` or ``cuda:N``), the address other
    sites would dial, and what each offered task reads in the site's folder (or why it cannot)."""
    device: str
    address: str
    offers: list[Offer]

    def lines(self) -> list[str]:
        """One phrase per task: ``task image-folder 0.1.0 (code SHA-256 <64 hex>): 600 samples in
        10 classes``, or why it cannot read the folder. The digest is the one the site registers
        (what a run pins: compare it with the release the federation agreed on)."""
        out = []
        for o in self.offers:
            code = f" (code SHA-256 {o.sha256})" if o.sha256 else ""
            name = f"task {o.name} {o.version}".rstrip() + code
            if o.usable:
                n = sum(a + b for a, b in o.summary.classes.values())
                out.append(f"{name}: {n} samples in {len(o.summary.classes)} classes")
            else:
                out.append(f"{name}: cannot read the folder ({o.error})")
        return out


def check_listen(listen: str) -> None:
    """``HOST:PORT`` with PORT 0-65535 (0: any free port). Raises ``ValueError``."""
    try:
        host, port = split_hostport(listen)
    except ValueError:
        raise ValueError(f"--listen must be HOST:PORT (e.g. 0.0.0.0:50071), not {listen!r}") from None
    if not host or not 0 <= port <= 65535:
        raise ValueError(f"--listen must be HOST:PORT with PORT 0-65535, not {listen!r}")


def check_serve_options(*, data_dir: Path, name: str, listen: str, coordinator: str, state_dir: Path, device: str,
                        transport: Transport, advertise: str | None = None, stall_timeout: float = 60.0,
                        weights_dir: Path | None = None, outbound_only: bool = False,
                        relay_after: float = 60.0, tasks: list[str] | None = None) -> CheckResult:
    """Every check ``fedrelay.peer.daemon.serve`` makes before it serves, plus the coordinator's
    address: the name (a DNS label) and that the TLS identity is that name; ``stall_timeout`` > 0;
    the state dir is writable (it is created if missing, as the daemon does); the device exists
    here; every offered task (``tasks``: names or ``module:attr``; None: every installed task)
    describes and reads the data folder (every sample is read: seconds per 10,000 images), at
    least one of them successfully, with valid class names; listen, advertise and coordinator
    addresses are ``HOST:PORT``, and a wildcard
    listen address comes with ``--advertise``; ``weights_dir``, when given, is a folder or absent.
    Binds no port and contacts no one.

    Raises ``fedrelay.DataError`` (a ``ValueError``) when no task can read the data folder and
    ``ValueError`` for everything else, with a message naming the option.
    """
    from fedrelay.peer.daemon import check_outbound, check_state_dir
    from fedrelay.peer.worker_main import Worker, resolve_device
    from fedrelay.peer.worker_protocol import Describe
    from fedrelay.task import DataError, DataSummary

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
        host, _ = split_hostport(advertise or listen)
        if host in ("0.0.0.0", "::") and not outbound_only:
            raise ValueError(f"listening on {listen}: pass --advertise HOST:PORT, the address other sites can reach")
        names.check_address(coordinator, "--coordinator")
        if weights_dir is not None and weights_dir.exists() and not weights_dir.is_dir():
            raise ValueError(f"--weights-dir {weights_dir} is not a folder")
    except names.InvalidName as exc:
        raise ValueError(str(exc)) from None
    check_state_dir(Path(state_dir))
    resolved = resolve_device(device)
    for t in tasks or ():
        task_registry.check_name(t)
    extra = [t for t in tasks or () if ":" in t]
    offered = task_registry.installed(extra=extra, only=tasks)
    usable = {n: i.sha256 for n, i in offered.items() if isinstance(i, task_registry.Installed)}
    found = Worker().answer(Describe(data=str(data_dir), device="cpu", tasks=usable, extra_tasks=extra)).tasks
    offers = []
    for name, inst in offered.items():
        got = found.get(name, {"error": f"{type(inst).__name__}: {inst}"})
        if "error" in got:
            installed = isinstance(inst, task_registry.Installed)
            offers.append(Offer(name=name, version=inst.version if installed else "",
                                sha256=inst.sha256 if installed else "", error=got["error"]))
            continue
        summary = DataSummary.from_dict(got["summary"])
        try:
            names.check_class_names(sorted(summary.classes), f"the classes task {name} reads in {data_dir}")
        except names.InvalidName as exc:
            raise ValueError(str(exc)) from None
        offers.append(Offer(name=name, version=inst.version, sha256=inst.sha256, models=tuple(got["models"]),
                            summary=summary, augmentations=tuple(got.get("augmentations") or ())))
    if not any(o.usable for o in offers):
        raise DataError(f"no task installed at this site can read {data_dir}: " + "; ".join(
            f"{o.name}: {o.error.removeprefix('DataError: ')}" for o in offers))
    return CheckResult(device=resolved, address="" if outbound_only else advertise or listen, offers=offers)
