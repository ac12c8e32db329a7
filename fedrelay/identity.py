"""A site's own identity: its private key and certificate signing request, made at the site.

The site's key never leaves the site. ``peer init`` (:func:`init_site`) makes an EC P-256 key
(the curve every fedrelay identity uses: TLS, signed reports, sealed relay payloads) and a
certificate signing request (CSR, PKCS#10) naming the site, in the site's TLS folder (default
``STATE_DIR/tls``)::

    TLS/key.pem        the private key (mode 0600, the folder 0700); never copied anywhere
    TLS/NAME.csr       the request: the site's name (CN and SAN), the hosts it is dialled at,
                       and its public key, signed by its key (proof the site holds the key)

The site sends ``NAME.csr`` to the federation's operator, who signs it with the CA
(``coordinator enroll --csr NAME.csr``, ``fedrelay.coordinator.pki.sign_csr``) and returns
``cert.pem`` and ``ca.pem``; :func:`install_certificate` (``peer install-cert``) checks they
fit the key and puts them beside it. The folder is then what ``peer serve --tls`` reads.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedrelay import names
from fedrelay.transport import CA_FILE, CERT_FILE, KEY_FILE

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CURVE = ec.SECP256R1  # P-256


class IdentityError(Exception):
    """A site identity that cannot be made or used (the message says why and what to do)."""


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh EC P-256 private key."""
    return ec.generate_private_key(CURVE())


def key_pem(key) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (no window with wider permissions),
    atomically (a temp file renamed onto ``path``)."""
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


def san(name: str, hosts) -> x509.SubjectAlternativeName:
    """The SAN of identity ``name``: the name as a DNS name, then each host (an IP address
    entry for an IP, else a DNS name), without repeats."""
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


def csr_path(folder: str | Path, name: str) -> Path:
    """Where :func:`init_site` writes ``name``'s request in ``folder``."""
    return Path(folder) / f"{name}.csr"


def init_site(name: str, folder: str | Path, *, hosts=DEFAULT_HOSTS, force: bool = False) -> Path:
    """Make site ``name``'s private key (``folder/key.pem``, mode 0600) and its certificate
    signing request (``folder/NAME.csr``, PEM) for the hosts ``hosts`` (host names or IPs other
    sites dial it at; the name itself is always in the SAN). Returns the CSR's path.

    Raises ``IdentityError`` for a bad site name, or when ``folder`` already holds a key and
    ``force`` is not set (a key is never replaced silently: a certificate issued for it would
    stop working).
    """
    try:
        names.check_site_name(name, "--name")
    except names.InvalidName as exc:
        raise IdentityError(str(exc)) from None
    folder = Path(folder)
    if (folder / KEY_FILE).exists() and not force:
        raise IdentityError(f"{folder / KEY_FILE} exists already: a site key is never replaced silently (its "
                            "certificate would stop working); pass --force to make a new key and request")
    key = new_key()
    request = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .add_extension(san(name, hosts), critical=False)
               .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    write_private(folder / KEY_FILE, key_pem(key), 0o600)
    # A new key makes an old certificate useless: drop it, so `peer serve` says what is missing.
    (folder / CERT_FILE).unlink(missing_ok=True)
    out = csr_path(folder, name)
    write_private(out, request.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def load_csr(pem: bytes, source: str = "the request") -> x509.CertificateSigningRequest:
    """A PEM (or DER) CSR, checked: its self-signature verifies, and its key is EC P-256.
    Raises ``IdentityError``."""
    try:
        csr = (x509.load_pem_x509_csr(pem) if pem.lstrip().startswith(b"-----")
               else x509.load_der_x509_csr(pem))
    except ValueError as exc:
        raise IdentityError(f"{source} is not a certificate signing request (PEM or DER): {exc}") from None
    if not csr.is_signature_valid:
        raise IdentityError(f"{source}: its signature does not verify (it was not signed by its own key, or "
                            "it was altered)")
    pub = csr.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or not isinstance(pub.curve, CURVE):
        raise IdentityError(f"{source}: the key must be EC P-256 (make it with `peer init`)")
    return csr


def request_fingerprint(csr: x509.CertificateSigningRequest) -> str:
    """SHA-256 (hex) of the request's DER bytes: the site reads it out (``peer init`` prints it)
    and the operator compares it with what ``enroll --csr`` prints, over a second channel (a
    phone call), before the certificate goes back."""
    return hashlib.sha256(csr.public_bytes(serialization.Encoding.DER)).hexdigest()


def csr_name(csr: x509.CertificateSigningRequest) -> str:
    """The common name a CSR asks for ('' when none)."""
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


def csr_hosts(csr: x509.CertificateSigningRequest) -> list[str]:
    """The hosts (DNS names and IPs) of a CSR's SAN, in order."""
    try:
        ext = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + \
        [str(v) for v in ext.get_values_for_type(x509.IPAddress)]


def _public_der(key_or_cert) -> bytes:
    pub = key_or_cert.public_key()
    return pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def install_certificate(folder: str | Path, cert_pem: bytes, ca_pem: bytes) -> Path:
    """Put the certificate the operator issued (``cert_pem``) and the federation's CA
    certificate (``ca_pem``) beside the site's key in ``folder`` (``cert.pem``, ``ca.pem``).
    Returns ``folder``. Raises ``IdentityError`` when the folder holds no key, the certificate
    is not for that key, or it was not issued by the CA."""
    folder = Path(folder)
    try:
        key = serialization.load_pem_private_key((folder / KEY_FILE).read_bytes(), password=None)
    except OSError as exc:
        raise IdentityError(f"cannot read {folder / KEY_FILE} ({exc.strerror}): run `peer init` first") from None
    except ValueError as exc:
        raise IdentityError(f"{folder / KEY_FILE} is not a PEM private key: {exc}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate: {exc}") from None
    if _public_der(cert) != _public_der(key):
        raise IdentityError(f"this certificate is not for the key in {folder / KEY_FILE} (was it issued for another "
                            "request, or was the key made again since?)")
    if not any(_issued_by(cert, ca) for ca in cas):
        raise IdentityError("this certificate was not issued by the CA certificate given (ca.pem)")
    write_private(folder / CERT_FILE, cert_pem, 0o644)
    write_private(folder / CA_FILE, ca_pem, 0o644)
    return folder


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except Exception:  # noqa: BLE001 - InvalidSignature, a wrong key type...: not this CA
        return False


def copy_certificate(src: str | Path, folder: str | Path) -> Path:
    """:func:`install_certificate` from a folder (an enrolment's ``--out``: ``cert.pem`` and
    ``ca.pem``). Raises ``IdentityError``."""
    src = Path(src)
    try:
        cert_pem, ca_pem = (src / CERT_FILE).read_bytes(), (src / CA_FILE).read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read {exc.filename} ({exc.strerror}); expected {CERT_FILE} and {CA_FILE} "
                            "from `coordinator enroll --csr`") from None
    return install_certificate(folder, cert_pem, ca_pem)
