"""What both daemons need on the wire: gRPC settings, channels, servers, and the model codec.

Every limit here is set on purpose (see ``PERF-NOTES`` in the design material: 1 MiB chunks
move ~3x faster than 64 KiB ones; gRPC's default 4 MiB receive cap must not decide anything):

- ``CHUNK_BYTES`` = 1 MiB: payload bytes per ``ModelChunk`` message.
- ``MAX_MESSAGE_BYTES`` = 8 MiB: send/receive cap for one gRPC message, on every channel and
  server. Chunks are 1 MiB, every other message is small; the cap leaves room and nothing more.
- Deadlines (seconds) for each kind of call: ``CONTROL_TIMEOUT`` for small control calls,
  ``transfer_timeout(n)`` for streams (a floor plus time for ``n`` bytes at a pessimistic
  ``MIN_TRANSFER_RATE``), ``EVALUATE_TIMEOUT`` for evaluation of a site's test split.

Transport security is set up here and nowhere else: a ``Transport`` is either mutual TLS from a
``--tls DIR`` folder (``key.pem``, ``cert.pem``, ``ca.pem``; see ``coordinator/pki.py``) or
explicitly insecure (plaintext), and every server (``make_server``) and channel
(``Transport.channel``) of both daemons and the CLI is made from one. ``caller_identity``
gives a server the certificate name of the caller. Every server also gets a
``fedrelay.guard.Guard`` (bounds on calls in flight per caller, a first-message deadline, clean
refusals, quiet logs) and connection limits (handshake timeout, idle timeout, streams per
connection).

Models are exchanged as safetensors only (``encode_state``/``decode_state``): nothing received
is ever unpickled or passed to ``torch.load``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

import grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 8 << 20
CONTROL_TIMEOUT = 30.0
EVALUATE_TIMEOUT = 900.0
MIN_TRANSFER_RATE = 5e6  # bytes/s assumed for a deadline; far below loopback and LAN speeds
TRANSFER_FLOOR = 60.0

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive so a dead TCP peer is noticed within a minute, not at the OS's 2-hour default.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
HANDSHAKE_TIMEOUT_MS = 10_000  # a connection must finish TLS and HTTP/2 set-up within 10 s
MAX_CONNECTION_IDLE_MS = 60_000  # a connection with no call for 1 minute is closed (GOAWAY)
MAX_STREAMS_PER_CONNECTION = 256  # calls at once on one connection (HTTP/2); above the guard's bounds, which do the limiting
_SERVER_OPTIONS = _OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    # Identity only: no compressed request is accepted (UNIMPLEMENTED), so a few KiB on the wire
    # cannot unpack into a large model stream or report (issue 28).
    ("grpc.compression_enabled_algorithms_bitset", 1),
]


def backoff_delays(first: float = 0.5, cap: float = 15.0):
    """The one retry policy of both daemons: exponential backoff with full jitter, 0.5 s, 1 s,
    2 s, ... capped at ``cap`` seconds (an endless generator of delays in seconds)."""
    import random

    delay = first
    while True:
        yield random.uniform(0.5 * delay, delay)
        delay = min(cap, delay * 2)


def transfer_timeout(total_bytes: int) -> float:
    """Deadline in seconds for streaming ``total_bytes`` bytes."""
    return TRANSFER_FLOOR + total_bytes / MIN_TRANSFER_RATE


# ---------------------------------------------------------------------------------------------
# Transport security

KEY_FILE, CERT_FILE, CA_FILE = "key.pem", "cert.pem", "ca.pem"
# The Peer methods the coordinator may call over the control stream of a site that only connects
# out (coordinator/tunnel.py, peer/control.py); site-to-site calls never go that way.
TUNNELED_METHODS = ("Assign", "Reroute", "EndRun", "Evaluate", "GetStatus", "FetchModel", "RelayReady", "Prepare",
                    "RelayQuota", "CheckPolicy")
COORDINATOR_IDENTITY = "coordinator"
OPERATOR_IDENTITY = "operator"
# Further operators (``coordinator enroll --operator NAME``): certificate name "operator.NAME".
# A site's name is one DNS label (no dot), so no site certificate can carry such a name.
OPERATOR_PREFIX = OPERATOR_IDENTITY + "."
# How a site's daemon words an assignment its own policy refused (peer/policy.py); the
# coordinator records such a refusal as the site's policy's (RunSummary.refused_by_policy).
POLICY_REFUSAL = "refused by this site's policy: "


def is_operator(identity: str | None) -> bool:
    """Whether a certificate name is an operator's: ``operator`` (made by ``init-ca``) or
    ``operator.NAME`` (``enroll --operator NAME``)."""
    return bool(identity) and (identity == OPERATOR_IDENTITY or (
        identity.startswith(OPERATOR_PREFIX) and len(identity) > len(OPERATOR_PREFIX)))


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
            return grpc.insecure_channel(address, options=_OPTIONS)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        options = list(_OPTIONS)
        if expect:
            options.append(("grpc.ssl_target_name_override", expect))
        return grpc.secure_channel(address, creds, options=options)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)


INSECURE = Transport.insecure()


def caller_identity(context) -> str | None:
    """The certificate name (CN) of the caller of a server call, or ``None`` on a plaintext
    server (no identities). On a TLS server every caller has one (client certificates are
    required)."""
    ctx = context.auth_context() or {}
    if ctx.get("transport_security_type") != [b"ssl"]:
        return None
    names = ctx.get("x509_common_name") or []
    return names[0].decode() if names else ""


def insecure_channel(address: str) -> grpc.Channel:
    """A plaintext channel to ``HOST:PORT`` (``INSECURE.channel``)."""
    return grpc.insecure_channel(address, options=_OPTIONS)


def make_server(listen: str, transport: Transport = INSECURE, guard=None, *, also: list[str] | tuple[str, ...] = (),
                max_connections: int | None = None) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``listen`` (``HOST:PORT``; port 0 picks a free one), with mutual TLS
    when ``transport`` is secure (daemons always pass theirs; the default is plaintext).

    Every call passes ``guard`` (a ``fedrelay.guard.Guard``; a new one with the default
    ``Limits`` when None): bounds on calls in flight per caller, a deadline for the first
    request message, clean refusals of malformed messages, rate-limited refusal logs. The
    worker pool has ``guard.limits.max_workers`` threads (started as needed). Connections must
    finish their handshake within ``HANDSHAKE_TIMEOUT_MS``, are closed after
    ``MAX_CONNECTION_IDLE_MS`` without a call, and carry at most ``MAX_STREAMS_PER_CONNECTION``
    calls at once; the process's open-files limit is raised and the listener accepts at most
    ``fedrelay.limits.max_connections`` connections at once (``fedrelay/limits.py``;
    ``max_connections`` overrides it).

    ``also``: more addresses (``HOST:PORT``) the same server listens on, each with a quota of
    connections of its own: the coordinator's operator listener (``--operator-listen``), which
    connections held on ``listen`` cannot fill. ``server.also_ports`` holds their bound ports.

    Returns (server, bound port of ``listen``). Raises ``RuntimeError`` when an address cannot
    be bound.
    """
    from concurrent import futures

    from fedrelay.guard import Guard

    from fedrelay import limits

    guard = guard if guard is not None else Guard()
    check_bindable(listen)
    # Connections are bounded per listener and by the open-files limit (fedrelay/limits.py).
    open_files = limits.raise_open_files()
    connections = max_connections if max_connections is not None else limits.max_connections(open_files)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=guard.limits.max_workers),
                         interceptors=[guard],
                         options=_SERVER_OPTIONS + [("grpc.max_allowed_incoming_connections", connections)])
    ports = []
    for address in (listen, *also):
        try:
            if transport.secure:
                port = server.add_secure_port(address, transport.server_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {address}: address in use or not available")
        ports.append(port)
    port = ports[0]
    server.also_ports = ports[1:]
    return server, port


def check_bindable(listen: str) -> None:
    """Raise ``RuntimeError`` (``cannot listen on LISTEN: ...``) when ``listen`` (``HOST:PORT``)
    is malformed, its host does not resolve, or its port is taken or not ours to bind, checked
    with a plain socket before gRPC tries: gRPC's C core would log its own line on stderr first,
    and a daemon would have opened its files. Port 0 (any free port) is not checked. A port taken
    between this check and gRPC's bind still fails, in gRPC's words."""
    import socket

    try:
        host, port = split_hostport(listen)
    except ValueError:
        raise RuntimeError(f"cannot listen on {listen!r}: expected HOST:PORT") from None
    if port == 0:
        return
    if not 0 < port <= 65535:
        raise RuntimeError(f"cannot listen on {listen}: the port must be 1-65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise RuntimeError(f"cannot listen on {listen}: the host {host!r} does not resolve ({exc})") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise RuntimeError(f"cannot listen on {listen}: {exc.strerror or exc}") from None


def split_hostport(address: str) -> tuple[str, int]:
    """``'host:port'`` or ``'[v6]:port'`` -> (host, port). Raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def with_port(listen: str, port: int) -> str:
    """Replace the port of ``listen`` (e.g. ``127.0.0.1:0`` -> ``127.0.0.1:43121``)."""
    host, _ = split_hostport(listen)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# Model codec and digests


def sha256_file(path: str | Path, chunk: int = CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def schema_digest(path: str | Path) -> str:
    """SHA-256 (hex) of a safetensors file's schema: its tensors' names, dtypes and shapes, read
    from the file's header alone (no torch; the data are not read). Both ends of a transfer
    report it, so the ledger can check that a payload is the run's model (or the strategy's
    payload) and not only that its bytes match. Raises ``ValueError`` for a file whose header
    is not safetensors."""
    import json

    from fedrelay.safetensors_header import HeaderError, read_header

    try:
        header = read_header(path, limit=MAX_MESSAGE_BYTES)
    except HeaderError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        entries = sorted((k, v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a safetensors header: {exc}") from None
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def encode_state(state: dict) -> bytes:
    """A state dict (name -> CPU tensor) as safetensors bytes.

    The encoding is deterministic (no run-specific metadata), so the same weights always have
    the same SHA-256: the ledger's digests identify models across runs.
    """
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata={"format": "pt"})


def decode_state(data: bytes) -> dict:
    """Safetensors bytes -> state dict of CPU tensors. Raises ``ValueError`` on malformed input."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(bytes(data))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except (SafetensorError, BaseException) as exc:  # the Rust parser raises several error types,
        # and a Rust panic surfaces as pyo3's PanicException, a BaseException
        raise ValueError(f"not a valid safetensors payload: {exc}") from exc


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content to: a temp file in the same folder (made if
    missing), fsynced and renamed onto ``path`` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename."""
    with atomic_file(path) as f:
        f.write(data)


def iter_file_chunks(path: str | Path, chunk: int = CHUNK_BYTES, start: int = 0) -> Iterator[bytes]:
    """The bytes of a file from byte ``start`` on, in pieces of at most ``chunk`` bytes."""
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(chunk):
            yield block


def status_message(exc: grpc.RpcError) -> str:
    """A one-line description of a failed call: ``CODE: details``."""
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # not a call error with a status
        return str(exc)


def assignment_refusal(exc: grpc.RpcError) -> tuple[str, bool]:
    """(reason, by its policy) of a site's refused ``Peer.Assign``: a refusal of the site's own
    policy (PERMISSION_DENIED worded with ``POLICY_REFUSAL``) gives the policy's reason and True;
    anything else ``status_message(exc)`` and False."""
    message = status_message(exc)
    try:
        code, details = exc.code(), exc.details() or ""
    except Exception:  # not a call error with a status
        return message, False
    if code == grpc.StatusCode.PERMISSION_DENIED and details.startswith(POLICY_REFUSAL):
        return details[len(POLICY_REFUSAL):], True
    return message, False


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
