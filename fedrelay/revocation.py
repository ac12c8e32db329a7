"""Certificate revocation: the CRL every daemon loads, reloads and enforces.

``coordinator revoke NAME`` (``fedrelay.coordinator.pki.revoke``) adds the serial numbers of the
certificates the CA issued to a site to the federation's certificate revocation list (an X.509
CRL, DER or PEM, signed by the CA's key) and publishes it: the coordinator records it in its
ledger and serves it (``Coordinator.GetCrl``; every ``RegisterReply`` says the number of the
newest, ``crl_number``), and an operator may also copy the file to the sites (``peer serve
--crl FILE``, ``coordinator relay --crl FILE``).

A :class:`RevocationList` is one daemon's current CRL:

- :meth:`RevocationList.update` takes a CRL only when it verifies with the federation's CA
  certificate and is newer (a higher CRL number) than the one held; an older or forged one is
  refused (``CrlError``) and the held one stays.
- :meth:`RevocationList.refused` says why a caller's certificate (PEM, from the TLS auth context)
  is refused, or None: ``fedrelay.guard.Guard`` asks it for every call, and cancels the calls in
  flight of a certificate that a new CRL revokes (a revoked site's running transfers stop).
- :meth:`RevocationList.watch_file` reloads a CRL file when it changes (checked every
  ``interval`` seconds, 10 by default; :meth:`RevocationList.reload_file` does one check now).
- ``names``: site name -> entry for the sites the coordinator says are revoked (GetCrl's
  entries), so that a sender stops sending to a revoked receiver (a client cannot see the
  server's certificate serial in gRPC Python; the receiver's name is what it dials).

A CRL never expires here: a daemon keeps enforcing the newest one it has (its ``nextUpdate``
is informative).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger("fedrelay.revocation")

CHECK_SECONDS = 10.0  # how often a watched CRL file is checked for a change


class CrlError(ValueError):
    """A CRL that cannot be used (not a CRL, not signed by the CA, older than the one held)."""


@dataclass(frozen=True)
class Revoked:
    """One revoked site as the coordinator's ledger holds it (``CrlEntry``)."""

    name: str
    serial: int
    revoked_at: float  # unix seconds
    revoked_by: str = ""
    reason: str = ""
    reinstated: bool = False  # the site was enrolled anew since (a new certificate, not on the list)

    def describe(self) -> str:
        when = dt.datetime.fromtimestamp(self.revoked_at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        by = f" by {self.revoked_by}" if self.revoked_by else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"revoked{by} at {when}{why}"


def load_crl(data: bytes, source: str = "the CRL") -> x509.CertificateRevocationList:
    """A CRL from PEM or DER bytes. Raises ``CrlError``."""
    try:
        if data.lstrip().startswith(b"-----"):
            return x509.load_pem_x509_crl(data)
        return x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise CrlError(f"{source} is not a certificate revocation list (PEM or DER): {exc}") from None


def crl_number(crl: x509.CertificateRevocationList) -> int:
    """The CRL's number (its CRLNumber extension; 0 when it has none)."""
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


def verify_crl(crl: x509.CertificateRevocationList, ca_pem: bytes, source: str = "the CRL") -> None:
    """Raise ``CrlError`` unless ``crl`` is signed by one of the CA certificates in ``ca_pem``."""
    for ca in x509.load_pem_x509_certificates(ca_pem):
        if crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key()):
            return
    raise CrlError(f"{source} is not signed by the federation's CA (issuer {crl.issuer.rfc4514_string()})")


def serial_of(cert_pem: bytes) -> int | None:
    """The serial number of a PEM certificate, None when it does not parse."""
    try:
        return x509.load_pem_x509_certificate(cert_pem).serial_number
    except ValueError:
        return None


class RevocationList:
    """One daemon's current CRL (see the module docstring). Thread-safe.

    ``ca_pem``: the federation's CA certificate(s), PEM (a daemon's ``Transport.ca``).
    ``on_change``: callables run with the set of newly revoked serials after each update (the
    guard cancels their calls in flight); an exception in one is logged, never raised.
    """

    def __init__(self, ca_pem: bytes | None):
        self.ca_pem = ca_pem
        self._lock = threading.Lock()
        self._crl: x509.CertificateRevocationList | None = None
        self._der = b""
        self._serials: dict[int, x509.RevokedCertificate] = {}
        self._names: dict[str, Revoked] = {}
        self._by_serial: dict[int, Revoked] = {}
        self._pem_serials: dict[bytes, int | None] = {}  # cache: a caller's certificate PEM -> serial
        self.on_change: list[Callable[[set[int]], None]] = []
        self._file: Path | None = None
        self._file_stamp: tuple | None = None
        self.changed = threading.Event()  # set at every update (tests wait on it)

    # -- what it holds -----------------------------------------------------------------------------
    @property
    def number(self) -> int:
        """The held CRL's number (0: none held)."""
        with self._lock:
            return crl_number(self._crl) if self._crl is not None else 0

    @property
    def der(self) -> bytes:
        """The held CRL, DER ("" when none)."""
        with self._lock:
            return self._der

    @property
    def serials(self) -> set[int]:
        with self._lock:
            return set(self._serials)

    def names(self) -> dict[str, Revoked]:
        """Site name -> entry, for the revoked sites the coordinator named (GetCrl's entries)."""
        with self._lock:
            return dict(self._names)

    def entry(self, serial: int) -> Revoked | None:
        with self._lock:
            return self._by_serial.get(serial)

    def revoked_name(self, name: str) -> Revoked | None:
        """The entry of site ``name`` when the coordinator said it is revoked, else None."""
        with self._lock:
            return self._names.get(name)

    def is_revoked(self, serial: int) -> bool:
        with self._lock:
            return serial in self._serials

    def refused(self, cert_pem: bytes) -> str | None:
        """Why a caller presenting ``cert_pem`` is refused (its serial is on the CRL), or None."""
        if not self._serials:
            return None
        serial = self.serial_for(cert_pem)
        with self._lock:
            if serial is None or serial not in self._serials:
                return None
            entry = self._by_serial.get(serial)
            revoked_at = self._serials[serial].revocation_date_utc
        said = entry.describe() if entry else f"revoked at {revoked_at:%Y-%m-%d %H:%M:%S} UTC"
        return f"this certificate (serial {serial:x}) was {said}: it is on the federation's revocation list"

    def serial_for(self, cert_pem: bytes) -> int | None:
        """The (cached) serial number of a caller's PEM certificate."""
        with self._lock:
            if cert_pem not in self._pem_serials:
                if len(self._pem_serials) > 4096:
                    self._pem_serials.clear()
                self._pem_serials[cert_pem] = serial_of(cert_pem)
            return self._pem_serials[cert_pem]

    # -- taking a new one ----------------------------------------------------------------------------
    def update(self, data: bytes, entries: list[Revoked] | None = None, source: str = "the CRL") -> bool:
        """Take the CRL ``data`` (PEM or DER) when it verifies with the CA and is newer than the
        one held; ``entries``: the coordinator's names for its serials. Returns True when taken,
        False when it is the one held (same number). Raises ``CrlError`` (not a CRL, not the
        CA's, older than the one held)."""
        crl = load_crl(data, source)
        if self.ca_pem:
            verify_crl(crl, self.ca_pem, source)
        number = crl_number(crl)
        with self._lock:
            held = crl_number(self._crl) if self._crl is not None else -1
            if number < held:
                raise CrlError(f"{source} is number {number}, older than the one held ({held}); kept that one")
            if number == held:
                if entries:
                    self._take_entries(entries)
                return False
            before = set(self._serials)
            self._crl = crl
            self._der = crl.public_bytes(serialization.Encoding.DER)
            self._serials = {r.serial_number: r for r in crl}
            if entries is not None:
                self._take_entries(entries)
            new = set(self._serials) - before
        log.info("revocation list %d loaded from %s: %d certificate(s) revoked%s", number, source,
                 len(self._serials), f", {len(new)} new" if new else "")
        self.changed.set()
        for callback in list(self.on_change):
            try:
                callback(new)
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                log.exception("a revocation listener failed")
        return True

    def _take_entries(self, entries: list[Revoked]) -> None:
        """Lock held."""
        self._names = {e.name: e for e in entries if e.serial in self._serials and not e.reinstated}
        self._by_serial = {e.serial: e for e in entries if e.serial in self._serials}

    # -- a CRL file ----------------------------------------------------------------------------------
    def reload_file(self, path: str | Path | None = None) -> bool:
        """Load the CRL file ``path`` (default: the watched one) when it changed since the last
        look (size, mtime, inode). Returns True when a newer CRL was taken. A missing or bad file
        is logged and the held CRL stays."""
        path = Path(path) if path is not None else self._file
        if path is None:
            return False
        try:
            st = path.stat()
        except OSError as exc:
            if self._file_stamp != ("missing",):
                log.warning("revocation list %s cannot be read (%s); keeping the one held", path, exc.strerror)
                self._file_stamp = ("missing",)
            return False
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if stamp == self._file_stamp:
            return False
        self._file_stamp = stamp
        try:
            return self.update(path.read_bytes(), source=str(path))
        except (CrlError, OSError) as exc:
            log.error("revocation list %s refused: %s", path, exc)
            return False

    def watch_file(self, path: str | Path, stop: threading.Event, interval: float = CHECK_SECONDS) -> None:
        """Load ``path`` now (raises ``CrlError`` when it is not the CA's CRL: said at start), then
        check it every ``interval`` seconds in a daemon thread until ``stop`` is set."""
        self._file = Path(path)
        try:
            data = self._file.read_bytes()
        except OSError as exc:
            raise CrlError(f"--crl {path}: cannot read it ({exc.strerror})") from None
        self.update(data, source=f"--crl {path}")
        st = self._file.stat()
        self._file_stamp = (st.st_size, st.st_mtime_ns, st.st_ino)

        def loop() -> None:
            while not stop.wait(interval):
                try:
                    self.reload_file()
                except Exception:  # noqa: BLE001 - said, and tried again at the next check
                    log.exception("checking the revocation list %s failed", path)

        threading.Thread(target=loop, name="crl-watch", daemon=True).start()


def entries_from_pb(reply) -> list[Revoked]:
    """The ``CrlEntry`` messages of a ``CrlReply`` as :class:`Revoked` entries (bad serials skipped)."""
    out = []
    for e in reply.entries:
        try:
            out.append(Revoked(e.name, int(e.serial, 16), e.revoked_at, e.revoked_by, e.reason, e.reinstated))
        except ValueError:
            continue
    return out


def follow(stub, revocations: RevocationList, number: int, revoked_sites: int | None = None,
           timeout: float = 10.0) -> bool:
    """A site's side of publication: when the coordinator's newest CRL (``number``, from a
    ``RegisterReply``) is newer than the one held, or it revokes another number of sites now
    (``revoked_sites``: a site enrolled anew is reinstated), fetch it (``Coordinator.GetCrl``)
    and take it. Returns True when a newer CRL was taken. Raises ``grpc.RpcError`` or
    ``CrlError``."""
    if number < revocations.number or (number == revocations.number and (
            revoked_sites is None or revoked_sites == len(revocations.names()))):
        return False
    from fedrelay.v1 import coordinator_pb2 as cpb

    reply = stub.GetCrl(cpb.CrlRequest(have=revocations.number), timeout=timeout)
    if not reply.crl:
        return False
    return revocations.update(reply.crl, entries_from_pb(reply), source="the coordinator's CRL")


def for_daemon(transport, *, keep: Path | None = None, crl_file: Path | None = None,
               stop: threading.Event | None = None, interval: float = CHECK_SECONDS) -> RevocationList:
    """The revocation list of a daemon with ``transport`` (its CA certificate verifies every list).

    ``keep``: a file where the newest list taken is kept (a site's ``STATE_DIR/crl.der``), loaded
    now, so that a restarted daemon enforces it before it hears from the coordinator.
    ``crl_file``: a CRL file the operator copies here (``--crl FILE``), loaded now (raises
    ``CrlError`` when it is not the CA's) and checked for changes every ``interval`` seconds
    until ``stop`` is set."""
    revocations = RevocationList(transport.ca if transport.secure else None)
    if keep is not None:
        if keep.exists():
            try:
                revocations.update(keep.read_bytes(), source=str(keep))
            except (CrlError, OSError) as exc:
                log.warning("the revocation list kept in %s is not used: %s", keep, exc)

        def persist(_new) -> None:
            from fedrelay.files import atomic_write

            atomic_write(keep, revocations.der)

        revocations.on_change.append(persist)
    if crl_file is not None:
        revocations.watch_file(crl_file, stop or threading.Event(), interval)
    return revocations
