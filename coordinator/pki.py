"""The federation's PKI: a CA, and a certificate per identity (``coordinator init-ca``,
``coordinator enroll``). Everything is made with the ``cryptography`` library (no openssl).

Layout of ``init-ca --out PKI``::

    PKI/ca/ca.pem, PKI/ca/ca-key.pem        the CA (keep ca-key.pem offline if you can)
    PKI/ca/issued/SERIAL.pem                every site certificate the CA issued (revocation finds them)
    PKI/ca/crl.pem                          the certificate revocation list (``coordinator revoke``)
    PKI/coordinator/{key.pem,cert.pem,ca.pem}  the coordinator's identity
    PKI/operator/{key.pem,cert.pem,ca.pem}     the operator's identity (for the CLI)

**A site makes its own key.** ``peer init`` (``fedrelay.identity.init_site``) writes the site's
private key and a certificate signing request (CSR) at the site; ``enroll --csr NAME.csr --ca PKI
--out DIR`` (:func:`sign_csr`) writes ``DIR/{cert.pem,ca.pem}``: the private key never leaves the
site. :func:`enroll` (``enroll NAME --out DIR`` without ``--csr``) does both halves in one process,
so the key is made where the CA is: **for local trials only** (the demo, tests on one machine).
Such a folder is what ``--tls DIR`` reads (``fedrelay.transport.Transport.from_dir``). Private keys
are written with mode 0600.

Identity is the certificate's subject common name (CN), also put in the SAN as a DNS name so a
client can verify it is talking to the identity it meant to reach. The roles are fixed by name:
CN ``coordinator`` is the coordinator, CN ``operator`` the operator; every other enrolled name is
a site. ``enroll`` therefore refuses those two names. Further operators are enrolled with
``enroll --operator NAME`` (:func:`operator_identity`): CN ``operator.NAME``, a name no site can
have (site names are one DNS label).
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedrelay import identity, names
from fedrelay.callers import COORDINATOR_IDENTITY, OPERATOR_IDENTITY, OPERATOR_PREFIX, is_operator
from fedrelay.transport import CA_FILE, CERT_FILE, KEY_FILE

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650
CERT_DAYS = 825
RESERVED = (COORDINATOR_IDENTITY, OPERATOR_IDENTITY)


class PKIError(Exception):
    """A PKI folder or request that cannot be used (message says why)."""


def check_name(name: str) -> None:
    """Raise ``PKIError`` unless ``name`` can be a site identity: a site name by
    ``fedrelay.names.check_site_name`` (the rule every daemon applies to the names it receives:
    1-63 of a-z, 0-9 and '-', not starting or ending with '-', a DNS label), and not a reserved
    role name."""
    try:
        names.check_site_name(name, "site name")
    except names.InvalidName as exc:
        raise PKIError(str(exc)) from None
    if name in RESERVED:
        raise PKIError(f"{name!r} is a reserved identity (the {name}'s, made by init-ca)")


_new_key = identity.new_key
_key_pem = identity.key_pem
_write = identity.write_private
_san = identity.san


def operator_identity(name: str) -> str:
    """The certificate name of the further operator ``name``: ``operator.NAME``. Raises
    ``PKIError`` unless ``name`` is a valid site-style name (one DNS label, not reserved)."""
    check_name(name)
    return OPERATOR_PREFIX + name


def _issue(name: str, ca_cert: x509.Certificate, ca_key, hosts, *, days: float,
           not_before: dt.datetime | None = None) -> tuple[bytes, bytes]:
    """A new key (PEM) and its certificate (PEM) for ``name``: for the CA's own identities
    (coordinator, operator), made with the CA."""
    key = _new_key()
    return _key_pem(key), _certify(name, key.public_key(), ca_cert, ca_key, hosts, days=days, not_before=not_before)


def _certify(name: str, public_key, ca_cert: x509.Certificate, ca_key, hosts, *, days: float,
             not_before: dt.datetime | None = None) -> bytes:
    """The certificate (PEM) of ``name`` for ``public_key``, signed by the CA."""
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(_san(name, hosts), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_identity(out: Path, key_pem: bytes, cert_pem: bytes, ca_pem: bytes) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    _write(out / KEY_FILE, key_pem, 0o600)
    _write(out / CERT_FILE, cert_pem, 0o644)
    _write(out / CA_FILE, ca_pem, 0o644)


def init_ca(out: str | Path, *, hosts=DEFAULT_HOSTS, name: str = "fedrelay CA", force: bool = False) -> Path:
    """Create a CA in ``out/ca`` and the coordinator's and operator's identities.

    ``hosts``: host names and IPs the coordinator is reached at (its certificate's SAN).
    Returns ``out``. Raises ``PKIError`` when ``out/ca`` exists already (unless ``force``).
    """
    out = Path(out)
    ca_dir = out / "ca"
    if (ca_dir / "ca-key.pem").exists() and not force:
        raise PKIError(f"{ca_dir} already holds a CA; refusing to overwrite it")
    key = _new_key()
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, key_encipherment=False, content_commitment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca_pem = cert.public_bytes(serialization.Encoding.PEM)
    ca_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(ca_dir, 0o700)
    _write(ca_dir / "ca-key.pem", _key_pem(key), 0o600)
    _write(ca_dir / "ca.pem", ca_pem, 0o644)
    for ident in RESERVED:
        k, c = _issue(ident, cert, key, hosts, days=CERT_DAYS)
        _write_identity(out / ident, k, c, ca_pem)
    return out


def load_ca(ca: str | Path) -> tuple[x509.Certificate, object, bytes]:
    """(certificate, private key, certificate PEM) of the CA made by ``init_ca`` in ``ca``
    (the PKI folder, or its ``ca/`` subfolder). Raises ``PKIError``."""
    ca = Path(ca)
    folder = ca / "ca" if (ca / "ca").is_dir() else ca
    try:
        ca_pem = (folder / "ca.pem").read_bytes()
        key_pem = (folder / "ca-key.pem").read_bytes()
    except OSError as exc:
        raise PKIError(f"{ca} is not a CA made by `coordinator init-ca` ({exc.strerror}: {exc.filename})") from exc
    try:
        cert = x509.load_pem_x509_certificate(ca_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise PKIError(f"unreadable CA in {folder}: {exc}") from exc
    return cert, key, ca_pem


def _keep_issued(ca: str | Path, cert_pem: bytes) -> None:
    """Keep a copy of an issued site certificate in ``ca/issued/SERIAL.pem`` (hex serial), so
    that ``coordinator revoke NAME`` finds every certificate issued to a name."""
    folder = _ca_folder(ca) / "issued"
    cert = x509.load_pem_x509_certificate(cert_pem)
    _write(folder / f"{cert.serial_number:x}.pem", cert_pem, 0o644)


def _ca_folder(ca: str | Path) -> Path:
    ca = Path(ca)
    return ca / "ca" if (ca / "ca").is_dir() else ca


def issued(ca: str | Path, name: str | None = None) -> list[x509.Certificate]:
    """The site certificates the CA in ``ca`` issued (kept in ``ca/issued``), only those naming
    ``name`` when given, oldest first."""
    out = []
    for path in sorted((_ca_folder(ca) / "issued").glob("*.pem")):
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except (OSError, ValueError):
            continue
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if name is None or (cns and cns[0].value == name):
            out.append(cert)
    return sorted(out, key=lambda c: c.not_valid_before_utc)


def sign_csr(csr_pem: bytes, ca: str | Path, *, name: str | None = None, hosts=None, days: float = CERT_DAYS,
             not_before: dt.datetime | None = None, source: str = "the request") -> tuple[str, bytes, bytes]:
    """Sign a site's certificate signing request (made by ``peer init``) with the CA in ``ca``.

    ``name``: the site the operator means to enrol (the request must name it; None: the name it
    asks for). ``hosts``: the SAN's hosts (None: those the request asks for). The key is the
    request's: the site's private key never comes here. Returns (site name, certificate PEM, CA
    certificate PEM); keeps a copy in ``ca/issued``. Raises ``PKIError`` (a bad or unsigned
    request, a key that is not P-256, a reserved or invalid name, a name other than ``name``,
    an unusable CA)."""
    try:
        csr = identity.load_csr(csr_pem, source)
    except identity.IdentityError as exc:
        raise PKIError(str(exc)) from None
    asked = identity.csr_name(csr)
    if not asked:
        raise PKIError(f"{source} names no site (no common name)")
    if name is not None and asked != name:
        raise PKIError(f"{source} is for {asked!r}, not {name!r}")
    check_name(asked)
    cert, key, ca_pem = load_ca(ca)
    hosts = list(hosts) if hosts else [h for h in identity.csr_hosts(csr) if h != asked]
    cert_pem = _certify(asked, csr.public_key(), cert, key, hosts, days=days, not_before=not_before)
    _keep_issued(ca, cert_pem)
    return asked, cert_pem, ca_pem


def enroll(name: str, ca: str | Path, out: str | Path, *, hosts=DEFAULT_HOSTS, days: float = CERT_DAYS,
           not_before: dt.datetime | None = None, allow_reserved: bool = False) -> Path:
    """Write a key and a certificate for site ``name`` (or the further operator
    ``operator.NAME``, see :func:`operator_identity`), signed by the CA in ``ca``, to ``out``.
    **For local trials** (the demo, tests), a site's enrolment runs both halves in one process:
    the site's key and request as ``peer init`` makes them (``fedrelay.identity.init_site``, in
    ``out``), then the request signed as ``enroll --csr`` does (:func:`sign_csr`). The key is
    thus made where the CA is; a real site runs ``peer init`` itself. A further operator's key is
    made here (the operators work at the CA's desk).

    Writes ``out/key.pem`` (0600), ``cert.pem``, ``ca.pem`` (and the request ``out/NAME.csr``).
    ``hosts``: host names and IPs other sites dial this site at (the SAN; the name itself is
    always added). ``days``: validity from ``not_before`` (default: now). Returns ``out``.
    Raises ``PKIError`` for a bad name or an unusable CA.
    """
    further_operator = is_operator(name) and name != OPERATOR_IDENTITY
    if further_operator:
        check_name(name[len(OPERATOR_PREFIX):])  # a further operator (operator_identity)
    elif not allow_reserved:
        check_name(name)
    out = Path(out)
    if further_operator or (allow_reserved and name in RESERVED):
        cert, key, ca_pem = load_ca(ca)
        k, c = _issue(name, cert, key, hosts, days=days, not_before=not_before)
        _write_identity(out, k, c, ca_pem)
        return out
    load_ca(ca)  # an unusable CA is said before a key is made
    try:
        request = identity.init_site(name, out, hosts=hosts, force=True)
    except identity.IdentityError as exc:
        raise PKIError(str(exc)) from None
    _, cert_pem, ca_pem = sign_csr(request.read_bytes(), ca, name=name, hosts=hosts, days=days,
                                   not_before=not_before)
    _write(out / CERT_FILE, cert_pem, 0o644)
    _write(out / CA_FILE, ca_pem, 0o644)
    return out


CRL_FILE = "crl.pem"
CRL_DAYS = 30  # the CRL's nextUpdate (informative: daemons keep enforcing the newest list they hold)


def crl_path(ca: str | Path) -> Path:
    """Where the CA in ``ca`` keeps its certificate revocation list."""
    return _ca_folder(ca) / CRL_FILE


def revoke(ca: str | Path, serials: list[int], *, reason: x509.ReasonFlags | None = None,
           when: dt.datetime | None = None) -> tuple[bytes, int]:
    """Add ``serials`` to the CA's certificate revocation list (``ca/crl.pem``; made when there
    is none) and sign the new list with the CA's key: its number is one more than the old one's,
    and every entry of the old list stays. Returns (the new list as DER, its number); the PEM is
    written to ``ca/crl.pem``. Raises ``PKIError`` (no serials, an unusable CA or old list)."""
    from fedrelay.revocation import CrlError, crl_number, load_crl

    if not serials:
        raise PKIError("nothing to revoke: no certificate serials")
    cert, key, _ = load_ca(ca)
    path = crl_path(ca)
    old = None
    if path.exists():
        try:
            old = load_crl(path.read_bytes(), str(path))
        except CrlError as exc:
            raise PKIError(str(exc)) from None
    now = when or dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(cert.subject)
               .last_update(now).next_update(now + dt.timedelta(days=CRL_DAYS))
               .add_extension(x509.CRLNumber((crl_number(old) if old is not None else 0) + 1), critical=False))
    kept = set()
    for entry in old or ():
        builder = builder.add_revoked_certificate(entry)
        kept.add(entry.serial_number)
    for serial in dict.fromkeys(serials):
        if serial in kept:
            continue
        entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now)
        if reason is not None:
            entry = entry.add_extension(x509.CRLReason(reason), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
    crl = builder.sign(key, hashes.SHA256())
    _write(path, crl.public_bytes(serialization.Encoding.PEM), 0o644)
    return crl.public_bytes(serialization.Encoding.DER), crl_number(crl)
