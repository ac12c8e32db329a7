"""The federation's PKI: a CA, and a key + certificate per identity (``coordinator init-ca``,
``coordinator enroll``). Everything is made with the ``cryptography`` library (no openssl).

Layout of ``init-ca --out PKI``::

    PKI/ca/ca.pem, PKI/ca/ca-key.pem        the CA (keep ca-key.pem offline if you can)
    PKI/coordinator/{key.pem,cert.pem,ca.pem}  the coordinator's identity
    PKI/operator/{key.pem,cert.pem,ca.pem}     the operator's identity (for the CLI)

and ``enroll NAME --ca PKI --out DIR`` writes ``DIR/{key.pem,cert.pem,ca.pem}`` for one site.
Such a folder is what ``--tls DIR`` reads (``fedrelay.wire.Transport.from_dir``). Private keys
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
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedrelay import names, wire
from fedrelay.wire import CA_FILE, CERT_FILE, COORDINATOR_IDENTITY, KEY_FILE, OPERATOR_IDENTITY

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


def operator_identity(name: str) -> str:
    """The certificate name of the further operator ``name``: ``operator.NAME``. Raises
    ``PKIError`` unless ``name`` is a valid site-style name (one DNS label, not reserved)."""
    check_name(name)
    return wire.OPERATOR_PREFIX + name


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (no window with wider permissions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _san(name: str, hosts) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.DNSName(name)]
    for h in hosts:
        h = h.strip().strip("[]")
        if not h:
            continue
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            entries.append(x509.DNSName(h))
    seen, out = set(), []
    for e in entries:
        if (type(e), e.value) not in seen:
            seen.add((type(e), e.value))
            out.append(e)
    return x509.SubjectAlternativeName(out)


def _issue(name: str, ca_cert: x509.Certificate, ca_key, hosts, *, days: float,
           not_before: dt.datetime | None = None) -> tuple[bytes, bytes]:
    key = _new_key()
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
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
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


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


def enroll(name: str, ca: str | Path, out: str | Path, *, hosts=DEFAULT_HOSTS, days: float = CERT_DAYS,
           not_before: dt.datetime | None = None, allow_reserved: bool = False) -> Path:
    """Write a key and a certificate for site ``name`` (or the further operator
    ``operator.NAME``, see :func:`operator_identity`), signed by the CA in ``ca``, to ``out``
    (``key.pem`` mode 0600, ``cert.pem``, ``ca.pem``).

    ``hosts``: host names and IPs other sites dial this site at (the SAN; the name itself is
    always added). ``days``: validity from ``not_before`` (default: now). Returns ``out``.
    Raises ``PKIError`` for a bad name or an unusable CA.
    """
    if wire.is_operator(name) and name != wire.OPERATOR_IDENTITY:
        check_name(name[len(wire.OPERATOR_PREFIX):])  # a further operator (operator_identity)
    elif not allow_reserved:
        check_name(name)
    cert, key, ca_pem = load_ca(ca)
    k, c = _issue(name, cert, key, hosts, days=days, not_before=not_before)
    out = Path(out)
    _write_identity(out, k, c, ca_pem)
    return out
