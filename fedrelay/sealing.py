"""Sealed envelopes: a payload file encrypted to one site and signed by another, so that a relay
can carry it to a site it cannot reach directly without ever seeing the plaintext.

Construction (ECIES-style hybrid encryption plus a signature; all sizes are in bytes):

* Key: a fresh (ephemeral) P-256 key per envelope; ECDH with the public key of the recipient's
  certificate; HKDF-SHA256 (salt = SHA-256 of the header bytes, which include the ephemeral public
  key; info = b"fedrelay seal v1") gives a 32-byte AES-256-GCM key. Only the holder of the
  recipient certificate's private key can derive it, and it is used for this one envelope.
* Segments: the plaintext is cut into ``segment_bytes`` pieces (``SEGMENT_BYTES`` when sealed; all
  full but the last; an empty payload is one empty last segment) so both sides stream the file
  and hold about one segment in memory. Segment i uses nonce = 4 zero bytes + i (8 bytes
  big-endian), which never repeats because the key is single-use, and AAD = SHA-256(header
  bytes) + i (8 bytes big-endian) + 1 byte "last segment" flag, so reordered, dropped, truncated
  or appended segments fail authentication.
* Signature: the sender signs MAGIC + header bytes with its certificate key (ECDSA P-256/SHA-256
  in this project; RSA-PSS/SHA-256 and Ed25519/Ed448 keys work too). The header binds the
  ephemeral key, the recipient certificate's fingerprint, the plaintext size and SHA-256 and the
  transfer identity (run_id, purpose, index, round, sender, receiver), so the signature
  authenticates the payload: the receiver checks the decrypted plaintext against the signed
  digest. (GCM alone proves nothing about the sender: anyone knowing the recipient's *public*
  key can encrypt to it.) The sender's certificate travels in the header; the receiver requires
  it to be signed by the federation CA, valid now, with CN == header["sender"].

Layout: MAGIC b"FRSEAL1\\n" | header length (4 bytes big-endian, <= 64 KiB) | header (canonical
JSON: sorted keys, compact separators, UTF-8) | signature length (2 bytes big-endian, <= 1024) |
DER signature | segments, each ciphertext + 16-byte GCM tag.

The relay sees the header in clear: names, sizes and the plaintext's SHA-256 (which lets it
confirm a guessed payload, not recover one). Every failure raises ``SealError`` (a ValueError)
with a one-line message, I/O errors included (chained as ``__cause__``).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

from fedrelay.files import atomic_file

MAGIC = b"FRSEAL1\n"
SEGMENT_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 10
MAX_SIGNATURE_BYTES = 1024
MAX_SEGMENT_BYTES = 64 << 20  # bound on an untrusted header's segment_bytes (memory per segment)
TAG_BYTES = 16
INFO = b"fedrelay seal v1"
REQUIRED = ("run_id", "purpose", "index", "round", "sender", "receiver")
ADDED = ("payload_bytes", "payload_sha256", "segment_bytes", "ephemeral_key", "recipient_cert_sha256",
         "sender_cert")
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
_DER, _PEM = serialization.Encoding.DER, serialization.Encoding.PEM


class SealError(ValueError):
    """An envelope that cannot be sealed or opened; the message (one line) says why."""


def _io_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            raise SealError(f"{exc.filename or 'file'}: {exc.strerror or exc}") from exc
    return wrapper


def _read_exact(f, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n and (chunk := f.read(n - len(buf))):
        buf += chunk
    return bytes(buf)


def _cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as exc:
        raise SealError(f"{what} is not a PEM certificate: {exc}") from None


def _key(pem: bytes, what: str):
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise SealError(f"{what} is not an unencrypted PEM private key: {exc}") from None


def _cn(cert: x509.Certificate, what: str) -> str:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not cns:
        raise SealError(f"{what} has no common name (identity)")
    return str(cns[0].value)


def _same_key(a, b) -> bool:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return a.public_bytes(_DER, spki) == b.public_bytes(_DER, spki)


def _p256(cert: x509.Certificate, what: str) -> ec.EllipticCurvePublicKey:
    pub = cert.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or not isinstance(pub.curve, ec.SECP256R1):
        kind = f"EC {pub.curve.name}" if isinstance(pub, ec.EllipticCurvePublicKey) else type(pub).__name__
        raise SealError(f"{what} ({_cn(cert, what)}) has key type {kind}; sealing needs EC P-256 (secp256r1)")
    return pub


def _check_issued(cert: x509.Certificate, ca_pem: bytes, what: str) -> None:
    """SealError unless ``cert`` is signed by one of the certificates in ``ca_pem`` and valid now."""
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except (ValueError, TypeError) as exc:
        raise SealError(f"the CA is not PEM certificates: {exc}") from None
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
            continue
        if not cert.not_valid_before_utc <= dt.datetime.now(dt.timezone.utc) <= cert.not_valid_after_utc:
            raise SealError(f"{what} ({_cn(cert, what)}) is valid from {cert.not_valid_before_utc} to "
                            f"{cert.not_valid_after_utc} only")
        return
    raise SealError(f"{what} ({_cn(cert, what)}) is not signed by the federation CA")


def _signing(key) -> tuple:
    """Extra arguments of ``key.sign``/``verify`` for a sender key (private or public) type."""
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        return (ec.ECDSA(hashes.SHA256()),)
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return (_PSS, hashes.SHA256())
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey, ed448.Ed448PrivateKey,
                        ed448.Ed448PublicKey)):
        return ()
    raise SealError(f"sender key type {type(key).__name__} cannot sign envelopes")


def _aes(shared: bytes, header_hash: bytes) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=header_hash, info=INFO).derive(shared))


def _count(size: int, seg: int) -> int:
    return max(1, -(-size // seg))


def _segments(size: int, seg: int, header_hash: bytes):
    """Yield (plaintext bytes, nonce, AAD) of each segment of a ``size``-byte payload."""
    count = _count(size, seg)
    for i in range(count):
        yield (min(seg, size - i * seg), bytes(4) + i.to_bytes(8, "big"),
               header_hash + i.to_bytes(8, "big") + bytes([i == count - 1]))


def _parse(f, name) -> tuple[bytes, dict]:
    """(header bytes, header) read from an open envelope, positioned after the header."""
    magic = _read_exact(f, len(MAGIC))
    if magic != MAGIC:
        if magic.startswith(b"FRSEAL"):
            raise SealError(f"{name}: unsupported envelope version {magic!r}; this build reads {MAGIC!r}")
        raise SealError(f"{name} is not a sealed envelope (bad magic)")
    raw = _read_exact(f, 4)
    n = int.from_bytes(raw, "big")
    if len(raw) < 4 or not 0 < n <= MAX_HEADER_BYTES:
        raise SealError(f"{name}: truncated envelope or header length {n} bytes out of 1..{MAX_HEADER_BYTES}")
    hb = _read_exact(f, n)
    if len(hb) < n:
        raise SealError(f"{name}: truncated envelope (header of {n} bytes cut at {len(hb)})")
    try:
        header = json.loads(hb.decode("utf-8"))
    except (ValueError, RecursionError):
        raise SealError(f"{name}: header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise SealError(f"{name}: header is not a JSON object")
    return hb, header


def _field(h: dict, key: str, kind: type, lo: int = 0, hi: int | None = None):
    v = h.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and not lo <= v <= (hi or v)):
        raise SealError(f"header field {key!r} is missing or not a valid {kind.__name__}: {v!r:.80}")
    return v


@_io_errors
def read_header(envelope: str | Path) -> dict:
    """The parsed header of ``envelope``, NOT verified (for logs). Raises ``SealError`` when the
    file is unreadable or not an envelope."""
    with open(envelope, "rb") as f:
        return _parse(f, envelope)[1]


@_io_errors
def seal_file(payload: str | Path, out: str | Path, *, header: dict, recipient_cert_pem: bytes,
              sender_key_pem: bytes, sender_cert_pem: bytes, ca_pem: bytes | None = None) -> tuple[int, str]:
    """Seal file ``payload`` to the holder of ``recipient_cert_pem``'s key, signed with
    ``sender_key_pem``, into ``out`` (written atomically: temp file in the same folder, fsync,
    ``os.replace``). Construction and layout: module docstring.

    ``header`` (str keys, JSON-serialisable values) must hold run_id, purpose, index, round, sender
    and receiver, and none of the fields this function adds: payload_bytes (plaintext size, bytes),
    payload_sha256 (hex), segment_bytes (plaintext bytes per segment), ephemeral_key (hex X9.62
    point), recipient_cert_sha256 (hex SHA-256 of the certificate's DER) and sender_cert (PEM).
    header["sender"] must be the sender certificate's CN. With ``ca_pem``, the recipient
    certificate must be signed by it, valid now, and have CN == header["receiver"].

    Returns (envelope size in bytes, SHA-256 hex of the envelope file). Raises ``SealError`` for
    any of the above, a recipient key that is not EC P-256, a sender key that does not match its
    certificate, a payload that changes while being read, and I/O errors.
    """
    payload, out = Path(payload), Path(out)
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise SealError("header must be a dict with str keys")
    if missing := [k for k in REQUIRED if k not in header]:
        raise SealError(f"header lacks {', '.join(missing)}")
    if clash := [k for k in ADDED if k in header]:
        raise SealError(f"header must not set {', '.join(clash)} (seal_file adds them)")
    rcert = _cert(recipient_cert_pem, "recipient certificate")
    rpub = _p256(rcert, "recipient certificate")
    if ca_pem is not None:
        _check_issued(rcert, ca_pem, "recipient certificate")
        if (cn := _cn(rcert, "recipient certificate")) != header["receiver"]:
            raise SealError(f"recipient certificate is {cn!r}'s, not receiver {header['receiver']!r}'s")
    skey, scert = _key(sender_key_pem, "sender key"), _cert(sender_cert_pem, "sender certificate")
    if not _same_key(skey.public_key(), scert.public_key()):
        raise SealError("sender key is not the key of the sender certificate")
    if (cn := _cn(scert, "sender certificate")) != header["sender"]:
        raise SealError(f"header sender {header['sender']!r} is not the sender certificate's name {cn!r}")
    seg, size, plain = SEGMENT_BYTES, 0, hashlib.sha256()
    with open(payload, "rb") as f:
        while chunk := f.read(seg):
            size += len(chunk)
            plain.update(chunk)
    eph = ec.generate_private_key(ec.SECP256R1())
    point = eph.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    h = dict(header, payload_bytes=size, payload_sha256=plain.hexdigest(), segment_bytes=seg,
             ephemeral_key=point.hex(), recipient_cert_sha256=hashlib.sha256(rcert.public_bytes(_DER)).hexdigest(),
             sender_cert=scert.public_bytes(_PEM).decode("ascii"))
    try:
        hb = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise SealError(f"header is not JSON-serialisable: {exc}") from None
    if len(hb) > MAX_HEADER_BYTES:
        raise SealError(f"header is {len(hb)} bytes; at most {MAX_HEADER_BYTES}")
    sig = skey.sign(MAGIC + hb, *_signing(skey))
    hh = hashlib.sha256(hb).digest()
    aes, env, check = _aes(eph.exchange(ec.ECDH(), rpub), hh), hashlib.sha256(), hashlib.sha256()
    head = MAGIC + len(hb).to_bytes(4, "big") + hb + len(sig).to_bytes(2, "big") + sig
    total = len(head)
    with atomic_file(out) as fo, open(payload, "rb") as f:
        fo.write(head)
        env.update(head)
        for n, nonce, aad in _segments(size, seg, hh):
            check.update(pt := _read_exact(f, n))
            fo.write(ct := aes.encrypt(nonce, pt, aad))
            env.update(ct)
            total += len(ct)
        if f.read(1) or check.digest() != plain.digest():
            raise SealError(f"{payload} changed while it was being sealed")
    return total, env.hexdigest()


@_io_errors
def open_file(envelope: str | Path, out: str | Path, *, recipient_key_pem: bytes, recipient_cert_pem: bytes,
              ca_pem: bytes, expect: dict) -> dict:
    """Verify ``envelope`` and decrypt it into ``out``; returns the (verified) header dict.

    Checks, in order: magic/version and header/signature lengths; the header's sender_cert is
    signed by a certificate in ``ca_pem`` (one or more PEM certificates) and valid now, and its CN
    equals header["sender"]; the signature over MAGIC + header verifies with it; the envelope was
    sealed to ``recipient_cert_pem`` (fingerprint; its CN must be header["receiver"]) and
    ``recipient_key_pem`` is that certificate's key; every ``expect`` item equals the header's
    (values compare after a JSON round trip: use lists, not tuples); the file size in bytes is
    the one the header implies. Then decrypts segment by segment into a temp file next to ``out``,
    checks the plaintext's SHA-256, fsyncs and ``os.replace``s it onto ``out``.

    Raises ``SealError`` on any failure (I/O errors included); the temp file is removed and
    ``out`` is left untouched.
    """
    envelope, out = Path(envelope), Path(out)
    rkey, rcert = _key(recipient_key_pem, "recipient key"), _cert(recipient_cert_pem, "recipient certificate")
    _p256(rcert, "recipient certificate")
    if not isinstance(rkey, ec.EllipticCurvePrivateKey) or not _same_key(rkey.public_key(), rcert.public_key()):
        raise SealError("recipient key is not the key of the recipient certificate")
    with open(envelope, "rb") as f:
        hb, h = _parse(f, envelope)
        raw = _read_exact(f, 2)
        n = int.from_bytes(raw, "big")
        sig = _read_exact(f, n)
        if len(raw) < 2 or not 0 < n <= MAX_SIGNATURE_BYTES or len(sig) < n:
            raise SealError(f"{envelope}: truncated envelope or signature length {n} out of 1..{MAX_SIGNATURE_BYTES}")
        sender = _cert(_field(h, "sender_cert", str).encode(), "sender certificate in the header")
        _check_issued(sender, ca_pem, "sender certificate")
        if (cn := _cn(sender, "sender certificate")) != h.get("sender"):
            raise SealError(f"header sender {h.get('sender')!r} is not the sender certificate's name {cn!r}")
        args = _signing(pub := sender.public_key())
        try:
            pub.verify(sig, MAGIC + hb, *args)
        except (InvalidSignature, ValueError):
            raise SealError("bad signature: header altered or not signed by the sender certificate's key") from None
        if h.get("recipient_cert_sha256") != hashlib.sha256(rcert.public_bytes(_DER)).hexdigest():
            raise SealError(f"envelope is sealed to another certificate (receiver {h.get('receiver')!r}), "
                            "not to recipient_cert_pem")
        if (cn := _cn(rcert, "recipient certificate")) != h.get("receiver"):
            raise SealError(f"header receiver {h.get('receiver')!r} is not the recipient certificate's name {cn!r}")
        for k, v in expect.items():
            if k not in h or h[k] != v:
                raise SealError(f"header {k}={h.get(k)!r:.80}, expected {v!r:.80}")
        size, digest = _field(h, "payload_bytes", int), _field(h, "payload_sha256", str)
        hh = hashlib.sha256(hb).digest()
        seg = _field(h, "segment_bytes", int, 1, MAX_SEGMENT_BYTES)
        count = _count(size, seg)
        want, have = f.tell() + size + TAG_BYTES * count, os.fstat(f.fileno()).st_size
        if have != want:
            raise SealError(f"{envelope}: {'truncated' if have < want else 'extended'} envelope: {have} bytes, "
                            f"the header implies {want}")
        try:
            eph = ec.EllipticCurvePublicKey.from_encoded_point(
                ec.SECP256R1(), bytes.fromhex(_field(h, "ephemeral_key", str)))
        except ValueError:
            raise SealError("header ephemeral_key is not a P-256 point") from None
        aes, plain = _aes(rkey.exchange(ec.ECDH(), eph), hh), hashlib.sha256()
        with atomic_file(out) as fo:
            for i, (n, nonce, aad) in enumerate(_segments(size, seg, hh)):
                try:
                    pt = aes.decrypt(nonce, _read_exact(f, n + TAG_BYTES), aad)
                except InvalidTag:
                    raise SealError(f"{envelope}: segment {i + 1} of {count} fails authentication "
                                    "(altered, truncated or reordered envelope)") from None
                plain.update(pt)
                fo.write(pt)
            if f.read(1):
                raise SealError(f"{envelope}: extended envelope (bytes after the last segment)")
            if plain.hexdigest() != digest:
                raise SealError(f"{envelope}: plaintext SHA-256 {plain.hexdigest()} is not the signed {digest}")
    return h
