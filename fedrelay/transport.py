"""How a process talks gRPC: mutual TLS from a ``--tls DIR`` folder, or explicitly plaintext.

Transport security is set up here and nowhere else: a :class:`Transport` is either mutual TLS
from a ``--tls DIR`` folder (``key.pem``, ``cert.pem``, ``ca.pem``; see ``coordinator/pki.py``
and ``fedrelay/identity.py``) or explicitly insecure (plaintext), and every channel
(``Transport.channel``) of both daemons and the CLI, and every server
(``fedrelay.server.make_server``), is made from one. Channels carry fedrelay's message size
cap (``fedrelay.calls.MAX_MESSAGE_BYTES``) and keepalive (``CHANNEL_OPTIONS``).
:func:`transport_mismatch` tells a client that dialled the other transport than its server's.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from fedrelay.addresses import split_hostport
from fedrelay.calls import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive so a dead TCP peer is noticed within a minute, not at the OS's 2-hour default.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

KEY_FILE, CERT_FILE, CA_FILE = "key.pem", "cert.pem", "ca.pem"
# The Peer methods the coordinator may call over the control stream of a site that only connects
# out (coordinator/tunnel_server.py, peer/tunnel_client.py); site-to-site calls never go that way.
TUNNELED_METHODS = ("Assign", "Reroute", "EndRun", "Evaluate", "GetStatus", "FetchModel", "RelayReady", "Prepare",
                    "RelayQuota", "CheckPolicy")


class TransportError(ValueError):
    """A ``--tls`` folder that cannot be used (missing file, bad PEM, key not matching...)."""


class Transport:
    """How a process talks gRPC: mutual TLS with its own identity, or plaintext.

    ``Transport.from_dir(DIR)`` reads ``DIR/key.pem`` (private key), ``DIR/cert.pem`` (this
    identity's certificate) and ``DIR/ca.pem`` (the federation's CA); servers then require a
    client certificate from that CA (``require_client_auth``), and clients present theirs and
    verify the server's. ``Transport.insecure()`` is plaintext: no identities at all.
    """

    def __init__(self, *, key: bytes | None = None, cert: bytes | None = None, ca: bytes | None = None,
                 identity: str | None = None, source: str = ""):
        self.key, self.cert, self.ca = key, cert, ca
        self.identity = identity
        self.source = source

    @property
    def secure(self) -> bool:
        return self.cert is not None

    @classmethod
    def insecure(cls) -> "Transport":
        return cls(source="insecure")

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Transport":
        """Mutual TLS from a folder made by ``coordinator init-ca``/``enroll``.

        Raises ``TransportError`` when a file is missing or unreadable, is not PEM, the key does
        not belong to the certificate, or the certificate is expired or not yet valid.
        """
        import datetime as dt

        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import NameOID

        folder = Path(folder)
        blobs = {}
        for name in (KEY_FILE, CERT_FILE, CA_FILE):
            try:
                blobs[name] = (folder / name).read_bytes()
            except OSError as exc:
                raise TransportError(f"--tls {folder}: cannot read {name} ({exc.strerror}); expected "
                                     f"{KEY_FILE}, {CERT_FILE} and {CA_FILE} as written by "
                                     "`coordinator init-ca`, or at a site `peer init` then `peer install-cert` (a site "
                                     "whose cert.pem is missing: its request awaits the operator's signature)") from exc
        try:
            cert = x509.load_pem_x509_certificate(blobs[CERT_FILE])
            x509.load_pem_x509_certificates(blobs[CA_FILE])
            key = serialization.load_pem_private_key(blobs[KEY_FILE], password=None)
        except (ValueError, TypeError) as exc:
            raise TransportError(f"--tls {folder}: not a PEM key/certificate: {exc}") from exc
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(serialization.Encoding.PEM, pub) != \
                cert.public_key().public_bytes(serialization.Encoding.PEM, pub):
            raise TransportError(f"--tls {folder}: {KEY_FILE} is not the key of {CERT_FILE}")
        now = dt.datetime.now(dt.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise TransportError(f"--tls {folder}: {CERT_FILE} is valid from {cert.not_valid_before_utc} to "
                                 f"{cert.not_valid_after_utc} only; enrol again")
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not cns:
            raise TransportError(f"--tls {folder}: {CERT_FILE} has no common name (identity)")
        return cls(key=blobs[KEY_FILE], cert=blobs[CERT_FILE], ca=blobs[CA_FILE], identity=str(cns[0].value),
                   source=str(folder))

    def channel(self, address: str, expect: str | None = None) -> grpc.Channel:
        """A channel to ``HOST:PORT`` with fedrelay's limits and keepalive.

        With TLS, the server's certificate must come from the CA and name ``expect`` (an identity:
        a site name or ``coordinator``) when given, else the host in ``address``.
        """
        if not self.secure:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        options = list(CHANNEL_OPTIONS)
        if expect:
            options.append(("grpc.ssl_target_name_override", expect))
        return grpc.secure_channel(address, creds, options=options)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)


INSECURE = Transport.insecure()


def insecure_channel(address: str) -> grpc.Channel:
    """A plaintext channel to ``HOST:PORT`` (``INSECURE.channel``)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def speaks_tls(address: str, timeout: float = 2.0) -> bool | None:
    """Whether the server at ``address`` (HOST:PORT) answers a TLS ClientHello with TLS: True
    (a TLS server: its first record is a handshake or an alert), False (it answered something
    else, or closed the connection: a plaintext gRPC server), None (no connection within
    ``timeout`` seconds). Sends one ClientHello and reads one reply; nothing is verified."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
    try:
        host, port = split_hostport(address)
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(hello)
            first = sock.recv(1)
    except (OSError, ValueError):
        return None
    return first[:1] in (b"\x16", b"\x15")


def transport_mismatch(exc: grpc.RpcError, address: str, secure: bool, what: str = "server") -> str | None:
    """A message for a failed call when the server at ``address`` speaks the other transport
    than this client (``secure``: the client used mutual TLS), else None; ``what`` names the
    server in the message ("coordinator", "peer"). Probes the server
    (:func:`speaks_tls`) only for a call that failed to connect (UNAVAILABLE)."""
    try:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return None
    except Exception:  # not a call error with a status
        return None
    server_tls = speaks_tls(address)
    if server_tls is True and not secure:
        return (f"the {what} at {address} speaks TLS and this call was plaintext (--insecure); "
                "pass --tls DIR (or set FEDRELAY_TLS) instead")
    if server_tls is False and secure:
        return (f"the {what} at {address} speaks plaintext (it was started with --insecure) and this call "
                "used --tls; pass --insecure (or restart the server with --tls)")
    return None
