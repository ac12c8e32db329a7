"""Signed records: what a site (or the coordinator) attests, in bytes anyone can verify later.

Under mutual TLS every report a site files for the ledger (``HopReport``, ``ReceiptReport``,
``FinalReport``, ``FailureReport``) and every evaluation it returns (``EvaluateReply``) is signed
with the private key of the site's TLS certificate; the coordinator signs each ended run's
``RunSeal``. The coordinator verifies a site's signature against the certificate the site
presented (mutual TLS; an evaluation carries its certificate, which must come from the CA and
name the site) before recording, and keeps the signed bytes, the signature and the certificate
in the ledger, where ``coordinator audit`` (``fedrelay.coordinator.audit``) checks them with
nothing but the CA certificate.

**Canonical encoding** (:func:`canonical`): the ASCII prefix ``fedrelay signed record v1\\n``,
the message's protobuf full name (e.g. ``fedrelay.v1.HopReport``) and ``\\n`` (domain
separation: a signature over one message type never verifies as another), then the message
serialized deterministically (``SerializeToString(deterministic=True)``: fields in field-number
order) with its ``signature`` field (and an ``EvaluateReply``'s ``certificate``) cleared. Those
exact bytes are what is signed and what the ledger stores, so a verifier needs no protobuf
schema to check a signature, only to read the fields (:func:`parse`). Both ends must speak the
same report messages (the same fedrelay version): a field one side does not know changes the
bytes.

**Signatures** (:class:`Signer`, :func:`verify`): with the key type of the certificate, ECDSA
with SHA-256 (the PKI's P-256 keys; DER-encoded signature), Ed25519, or RSA PKCS#1 v1.5 with
SHA-256. Certificates are identified by their fingerprint: the SHA-256 of their DER bytes (hex).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import NameOID

PREFIX = b"fedrelay signed record v1\n"
MAX_SIGNATURE_BYTES = 1024  # longer than any ECDSA, Ed25519 or RSA-4096 signature
# Coordinator methods whose request is a signed report (a site signs it before the call).
SIGNED_REPORTS = ("ReportHop", "ReportReceipt", "ReportFinal", "ReportFailure")
# Fields a signature does not cover (they carry it).
_UNSIGNED_FIELDS = ("signature", "certificate")


class SignatureError(ValueError):
    """A record whose signature or certificate does not verify (the message says which and why)."""


# -- canonical encoding --------------------------------------------------------------------------
def canonical(message) -> bytes:
    """The bytes a signature over ``message`` (a protobuf message) covers: the prefix, the
    message type's full name and the deterministic serialization of the message with its
    ``signature`` (and ``certificate``) fields empty. The message itself is not changed."""
    bare = type(message)()
    bare.CopyFrom(message)
    for name in _UNSIGNED_FIELDS:
        if name in bare.DESCRIPTOR.fields_by_name:
            bare.ClearField(name)
    return PREFIX + bare.DESCRIPTOR.full_name.encode() + b"\n" + bare.SerializeToString(deterministic=True)


def record_type(record: bytes) -> str:
    """The message type's full name a canonical record names (e.g. ``fedrelay.v1.HopReport``).
    Raises ``SignatureError`` for bytes that are not a canonical record."""
    if not record.startswith(PREFIX) or b"\n" not in record[len(PREFIX):]:
        raise SignatureError("not a fedrelay signed record (its prefix is missing)")
    return record[len(PREFIX):].split(b"\n", 1)[0].decode("ascii", "replace")


def parse(record: bytes, message_class):
    """The message of class ``message_class`` encoded in the canonical ``record``. Raises
    ``SignatureError`` when the record names another message type or does not parse."""
    name = record_type(record)
    if name != message_class.DESCRIPTOR.full_name:
        raise SignatureError(f"the record is a {name}, not a {message_class.DESCRIPTOR.full_name}")
    body = record[len(PREFIX) + len(name.encode()) + 1:]
    msg = message_class()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise SignatureError(f"the {name} record does not parse: {exc}") from None
    return msg


# -- certificates --------------------------------------------------------------------------------
def load_certificate(pem: bytes | str) -> x509.Certificate:
    """A certificate from PEM. Raises ``SignatureError``."""
    try:
        return x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str) else bytes(pem))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"not a PEM certificate: {exc}") from None


def load_ca(pem: bytes | str) -> list[x509.Certificate]:
    """The CA certificates in a PEM file's bytes (one or more). Raises ``SignatureError``."""
    try:
        certs = x509.load_pem_x509_certificates(pem.encode() if isinstance(pem, str) else bytes(pem))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"not a PEM CA certificate: {exc}") from None
    if not certs:
        raise SignatureError("no certificate in the CA file")
    return certs


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 (hex) of the certificate's DER bytes: how the ledger names a certificate."""
    return cert.fingerprint(hashes.SHA256()).hex()


def common_name(cert: x509.Certificate) -> str:
    """The certificate's subject common name (the fedrelay identity), "" when it has none."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


def check_certificate(cert: x509.Certificate, ca: list[x509.Certificate], name: str,
                      at: float | None = None) -> None:
    """Raise ``SignatureError`` unless ``cert`` was issued (signed) by one of the ``ca``
    certificates, names ``name`` (its common name) and, when ``at`` (unix seconds) is given, was
    valid then."""
    for issuer in ca:
        try:
            cert.verify_directly_issued_by(issuer)
            break
        except (ValueError, TypeError, InvalidSignature):
            continue
    else:
        issuer = cert.issuer.rfc4514_string()
        if any(c.subject == cert.issuer for c in ca):
            why = f"its issuer is named {issuer!r} like the CA, but the CA's key did not sign it (another CA's)"
        else:
            why = f"it was issued by {issuer!r}, not by the CA ({', '.join(c.subject.rfc4514_string() for c in ca)})"
        raise SignatureError(f"its certificate ({cert.subject.rfc4514_string()}) is not signed by the CA: {why}")
    if common_name(cert) != name:
        raise SignatureError(f"its certificate names {common_name(cert)!r}, not {name!r}")
    if at is not None:
        when = dt.datetime.fromtimestamp(at, dt.timezone.utc)
        if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
            raise SignatureError(f"its certificate was not valid at {when:%Y-%m-%d %H:%M:%S %Z} (valid from "
                                 f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} to "
                                 f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC)")


# -- signing and verifying -----------------------------------------------------------------------
def verify(record: bytes, signature: bytes, cert: x509.Certificate) -> None:
    """Raise ``SignatureError`` unless ``signature`` is the certificate key's signature over
    ``record`` (ECDSA/SHA-256, Ed25519 or RSA PKCS#1 v1.5/SHA-256, by the key's type)."""
    if not signature:
        raise SignatureError("it is not signed")
    if len(signature) > MAX_SIGNATURE_BYTES:
        raise SignatureError(f"its signature is {len(signature)} bytes long (at most {MAX_SIGNATURE_BYTES})")
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, record, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, record)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, record, padding.PKCS1v15(), hashes.SHA256())
        else:
            raise SignatureError(f"its certificate's key type ({type(key).__name__}) cannot sign records")
    except InvalidSignature:
        raise SignatureError(f"its signature does not verify with the key of {common_name(cert)!r}'s "
                             "certificate") from None


class Signer:
    """Signs records with one identity's private key (``key_pem``, PKCS#8 or traditional PEM)
    and certificate (``cert_pem``). Raises ``SignatureError`` when the key cannot sign or does
    not belong to the certificate."""

    def __init__(self, key_pem: bytes, cert_pem: bytes):
        try:
            self._key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise SignatureError(f"not a PEM private key: {exc}") from None
        self.certificate_pem = bytes(cert_pem)
        self.certificate = load_certificate(cert_pem)
        self.name = common_name(self.certificate)
        if not isinstance(self._key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey, rsa.RSAPrivateKey)):
            raise SignatureError(f"a {type(self._key).__name__} cannot sign records")
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        if self._key.public_key().public_bytes(serialization.Encoding.DER, pub) != \
                self.certificate.public_key().public_bytes(serialization.Encoding.DER, pub):
            raise SignatureError("the private key does not belong to the certificate")

    def sign_bytes(self, record: bytes) -> bytes:
        """The signature over ``record``."""
        if isinstance(self._key, ec.EllipticCurvePrivateKey):
            return self._key.sign(record, ec.ECDSA(hashes.SHA256()))
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            return self._key.sign(record)
        return self._key.sign(record, padding.PKCS1v15(), hashes.SHA256())

    def sign(self, message):
        """A copy of ``message`` with its ``signature`` field set (and its ``certificate`` field,
        when it has one, to this identity's certificate)."""
        out = type(message)()
        out.CopyFrom(message)
        if "certificate" in out.DESCRIPTOR.fields_by_name:
            out.certificate = self.certificate_pem
        out.signature = self.sign_bytes(canonical(out))
        return out


def signer_for(transport) -> Signer | None:
    """The :class:`Signer` of a ``fedrelay.transport.Transport``'s identity, or None for a plaintext
    transport (nothing is signed there). Made once per transport."""
    if not transport.secure:
        return None
    signer = getattr(transport, "_signer", None)
    if signer is None or signer.certificate_pem != bytes(transport.cert):
        signer = Signer(transport.key, transport.cert)
        transport._signer = signer
    return signer


class SigningStub:
    """A ``CoordinatorStub`` whose report calls (:data:`SIGNED_REPORTS`) sign their request with
    ``signer`` first (each call: a retried report is signed again); every other method, and
    every call when ``signer`` is None (plaintext), passes through unchanged."""

    def __init__(self, stub, signer: Signer | None):
        self._stub = stub
        self._signer = signer

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        if self._signer is None or name not in SIGNED_REPORTS:
            return method
        signer = self._signer

        def call(request, *args, **kwargs):
            return method(signer.sign(request), *args, **kwargs)

        return call


# -- what the ledger keeps -----------------------------------------------------------------------
@dataclass(frozen=True)
class SignedRecord:
    """One record as the ledger keeps it: ``signer`` (the identity, a certificate name),
    ``record`` (the canonical bytes), ``signature`` (b"" when unsigned: a plaintext run) and
    ``certificate`` (the signer's certificate PEM; b"" when unsigned)."""

    signer: str
    record: bytes
    signature: bytes = b""
    certificate: bytes = b""

    @property
    def type(self) -> str:
        """The message type's short name, e.g. ``HopReport``."""
        return record_type(self.record).rsplit(".", 1)[-1]

    @property
    def certificate_sha256(self) -> str:
        """The certificate's fingerprint ("" when unsigned)."""
        return fingerprint(load_certificate(self.certificate)) if self.certificate else ""

    def binding(self) -> str:
        """What an event of the ledger's hash chain stores to bind this record: the SHA-256 (hex)
        of the record, its signature and its certificate's fingerprint, each length-prefixed."""
        return binding_digest(self.record, self.signature, self.certificate_sha256)


def binding_digest(record: bytes, signature: bytes, certificate_sha256: str) -> str:
    """:meth:`SignedRecord.binding` from its parts (an auditor recomputes it from a ledger row)."""
    h = hashlib.sha256(b"fedrelay record binding v1\n")
    for part in (record, signature, certificate_sha256.encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def unsigned(signer: str, message) -> SignedRecord:
    """The record of ``message`` from ``signer`` without a signature (a plaintext run)."""
    return SignedRecord(signer, canonical(message))


def received(message, signer: str, certificate_pem: bytes) -> SignedRecord:
    """The record of a signed ``message`` from ``signer``, verified against ``certificate_pem``
    (the certificate the signer presented over mutual TLS). Raises ``SignatureError``."""
    cert = load_certificate(certificate_pem)
    record = canonical(message)
    verify(record, message.signature, cert)
    return SignedRecord(signer, record, bytes(message.signature), bytes(certificate_pem))
