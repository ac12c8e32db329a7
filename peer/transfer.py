"""Moving a model between peers: chunked streams, size and digest checks, validation.

A model stream is one ``TransferHeader`` followed by the safetensors payload in chunks of at most
``fedrelay.calls.CHUNK_BYTES``. The receiver

1. checks the header (via the caller's ``check_header``: known run, expected sender and hop,
   size under the cap),
2. writes the chunks to a temporary file beside the destination while updating SHA-256
   (so hashing overlaps the transfer), refusing a stream longer than declared,
3. refuses a truncated stream or a digest mismatch,
4. parses the tensors with safetensors only (``check_payload``: names, shapes, dtypes, finite)
   while the file is fsynced,
5. and only then renames the file into place.

Speed: data chunks are decoded without protobuf copies (``decode_chunk``) and sent
pre-serialized (``encoded_model_stream``); the wire format is the one ``proto/`` defines.

Any refusal removes the temporary file: nothing is left on disk. Refusals are ``TransferError``
carrying the gRPC status code to answer with.

Resuming (issue #5): with ``resumable=True`` the temporary file has a fixed name per
(destination, SHA-256), :func:`partial_path`. A stream that *breaks* after its header was
accepted (the call was cancelled or cut, it ended short of the declared size, the sender
stalled, or a newer stream of the same transfer superseded it) leaves that file in place,
fsynced; the sender asks how much is held (``Peer.TransferOffset``, :func:`held_bytes`) and
sends the rest with ``TransferHeader.offset``. The receiver re-hashes the bytes it holds, so
the SHA-256 check still covers the whole payload. A refused stream (a bad header, more bytes
than declared, a digest mismatch, a payload that is not the run's model) still leaves nothing.
At most one partial file exists per destination: a stream for another digest removes the
older one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc

from fedrelay import names
from fedrelay.calls import CHUNK_BYTES, CONTROL_TIMEOUT, transfer_timeout
from fedrelay.files import iter_file_chunks
from fedrelay.transport import insecure_channel
from fedrelay.v1 import common_pb2, peer_pb2

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message framing: 1 flag byte + 4 length bytes


HANDOFF_METHOD = "/fedrelay.v1.Peer/Handoff"
_DATA_TAG = b"\x12"  # ModelChunk field 2 (data), wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_data_chunk(block: bytes) -> bytes:
    """A ``ModelChunk(data=block)`` serialized by hand: tag, length, bytes (one copy)."""
    return b"".join((_DATA_TAG, _varint(len(block)), block))


class DataView:
    """A data chunk decoded without copying: ``.data`` is a memoryview of the received bytes.
    Quacks like ``ModelChunk`` where the receive path looks (``WhichOneof("kind")``, ``.data``)."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview):
        self.data = data

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - protobuf's name
        return "data"


def decode_chunk(raw: bytes) -> common_pb2.ModelChunk | DataView:
    """Request deserializer of ``Peer.Handoff``: a data chunk becomes a zero-copy view of its
    payload bytes (:class:`DataView`); anything else (the header, or any other valid encoding)
    is parsed by protobuf.

    Protobuf would copy every 1 MiB ``bytes`` field on parse and again on access; the wire
    format is unchanged, so any standard protobuf client can still send handoffs.
    Raises ``google.protobuf.message.DecodeError`` on a malformed message.
    """
    if raw[:1] == _DATA_TAG:
        length, pos, shift = 0, 1, 0
        while pos < len(raw) and pos <= 10:
            byte = raw[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                if pos + length == len(raw):
                    return DataView(memoryview(raw)[pos:])
                break
            shift += 7
    return common_pb2.ModelChunk.FromString(raw)


def add_peer_servicer(servicer, server) -> None:
    """Register a Peer servicer like the generated ``add_PeerServicer_to_server``, but with
    :func:`decode_chunk` as ``Handoff``'s request deserializer (the zero-copy receive path)."""
    handlers = {
        "Assign": grpc.unary_unary_rpc_method_handler(
            servicer.Assign, request_deserializer=peer_pb2.Assignment.FromString,
            response_serializer=peer_pb2.AssignReply.SerializeToString),
        "Handoff": grpc.stream_unary_rpc_method_handler(
            servicer.Handoff, request_deserializer=decode_chunk,
            response_serializer=peer_pb2.HandoffReceipt.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, request_deserializer=peer_pb2.StatusRequest.FromString,
            response_serializer=peer_pb2.PeerStatus.SerializeToString),
        "Evaluate": grpc.unary_unary_rpc_method_handler(
            servicer.Evaluate, request_deserializer=peer_pb2.EvaluateRequest.FromString,
            response_serializer=peer_pb2.EvaluateReply.SerializeToString),
        "FetchModel": grpc.unary_stream_rpc_method_handler(
            servicer.FetchModel, request_deserializer=peer_pb2.FetchModelRequest.FromString,
            response_serializer=common_pb2.ModelChunk.SerializeToString),
        "TransferOffset": grpc.unary_unary_rpc_method_handler(
            servicer.TransferOffset, request_deserializer=common_pb2.TransferHeader.FromString,
            response_serializer=peer_pb2.TransferOffsetReply.SerializeToString),
        "Reroute": grpc.unary_unary_rpc_method_handler(
            servicer.Reroute, request_deserializer=peer_pb2.RerouteRequest.FromString,
            response_serializer=peer_pb2.RerouteReply.SerializeToString),
        "EndRun": grpc.unary_unary_rpc_method_handler(
            servicer.EndRun, request_deserializer=peer_pb2.EndRunRequest.FromString,
            response_serializer=peer_pb2.EndRunReply.SerializeToString),
        "Prepare": grpc.unary_unary_rpc_method_handler(
            servicer.Prepare, request_deserializer=peer_pb2.PrepareRequest.FromString,
            response_serializer=peer_pb2.PrepareReply.SerializeToString),
        "RelayReady": grpc.unary_unary_rpc_method_handler(
            servicer.RelayReady, request_deserializer=peer_pb2.RelayNotice.FromString,
            response_serializer=peer_pb2.RelayReadyReply.SerializeToString),
        "RelayQuota": grpc.unary_unary_rpc_method_handler(
            servicer.RelayQuota, request_deserializer=peer_pb2.RelayQuotaRequest.FromString,
            response_serializer=peer_pb2.RelayQuotaReply.SerializeToString),
        "CheckPolicy": grpc.unary_unary_rpc_method_handler(
            servicer.CheckPolicy, request_deserializer=peer_pb2.Assignment.FromString,
            response_serializer=peer_pb2.PolicyVerdict.SerializeToString),
    }
    missing = set(peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods_by_name) - set(handlers)
    if missing:  # the .proto grew a method: register it here too
        raise RuntimeError(f"add_peer_servicer does not register {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fedrelay.v1.Peer", handlers),))
    server.add_registered_method_handlers("fedrelay.v1.Peer", handlers)


class TransferError(Exception):
    """A refused transfer: ``code`` is the gRPC status the receiver answers with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Received:
    header: common_pb2.TransferHeader
    path: Path
    size: int  # payload bytes (the whole payload, also when the stream resumed at an offset)
    sha256: str


def partial_path(dest: Path, sha256: str) -> Path:
    """Where a resumable transfer of the payload ``sha256`` into ``dest`` keeps its bytes."""
    return dest.parent / f".{dest.name}.{sha256}.part"


def remove_partials(folder: Path) -> int:
    """Remove every partial transfer file in ``folder`` (the resumable ones of
    :func:`partial_path` and the temporary ones of non-resumable streams, both
    ``.<dest>.*.part``). Returns the bytes removed."""
    removed = 0
    for part in folder.glob(".*.part"):
        try:
            size = part.stat().st_size
            part.unlink()
            removed += size
        except FileNotFoundError:
            pass
    return removed


def held_bytes(dest: Path, sha256: str) -> int:
    """Bytes of the payload ``sha256`` already held for ``dest`` from a broken stream (0: none)."""
    try:
        return partial_path(dest, sha256).stat().st_size
    except FileNotFoundError:
        return 0


class TruncatedStream(TransferError):
    """The stream ended before its declared size (DATA_LOSS). A cut stream can look like this to
    the receiver: gRPC may end a cancelled call's request iterator instead of raising."""

    def __init__(self, size: int, total: int):
        super().__init__(grpc.StatusCode.DATA_LOSS, f"truncated stream: {size} of {total} declared bytes")


def _broken(exc: BaseException) -> bool:
    """Did the stream break (worth resuming), rather than get refused?"""
    if isinstance(exc, TruncatedStream):
        return True
    if isinstance(exc, TransferError):
        return exc.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
    return isinstance(exc, (grpc.RpcError, KeyboardInterrupt, SystemExit))


def check_header_fields(header: common_pb2.TransferHeader) -> None:
    """The checks a transfer header gets before anything else. Raises ``TransferError``:
    INVALID_ARGUMENT (a run id, sender, hop or SHA-256 that breaks its ``fedrelay.names`` rule,
    a zero size) or OUT_OF_RANGE (an offset beyond the size)."""
    try:
        names.check_transfer_header(header)
    except names.InvalidName as exc:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    if header.total_bytes == 0:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "header.total_bytes must be > 0")
    if header.offset > header.total_bytes:
        raise TransferError(grpc.StatusCode.OUT_OF_RANGE, "header.offset is beyond header.total_bytes")


def receive_model(
    chunks: Iterable[common_pb2.ModelChunk],
    dest: Path,
    check_header: Callable[[common_pb2.TransferHeader], Path | None],
    check_payload: Callable[[bytes], None],
    *,
    resumable: bool = False,
) -> Received:
    """Receive a model stream into ``dest`` (or where ``check_header`` says).

    ``check_header(header)`` raises ``TransferError`` to refuse before any byte is written; it
    may return another destination path. ``check_payload(data)`` raises ``ValueError`` when the
    safetensors content does not fit the run. ``resumable``: keep the bytes of a broken stream
    for a later stream with ``header.offset`` (module docstring); without it a header with an
    offset is refused. Raises ``TransferError``: INVALID_ARGUMENT (no header first, a second
    header, malformed payload), OUT_OF_RANGE (longer than declared), DATA_LOSS (truncated,
    SHA-256 mismatch), FAILED_PRECONDITION (an offset beyond the bytes held), or whatever
    ``check_header`` raises.
    """
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: expected a header") from None
    if first.WhichOneof("kind") != "header":
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a header")
    header = first.header
    check_header_fields(header)
    if header.offset and not resumable:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "this receiver does not resume transfers (offset > 0)")
    dest = check_header(header) or dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = header.offset
    if resumable:
        tmp = partial_path(dest, header.sha256)
        for other in dest.parent.glob(f".{dest.name}.*.part"):
            if other != tmp:
                other.unlink(missing_ok=True)  # one partial per destination: the newest digest wins
        if size and held_bytes(dest, header.sha256) < size:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"only {held_bytes(dest, header.sha256)} bytes are held, not {size}: ask the offset again")
        f = open(tmp, "r+b" if size else "wb")
        try:
            f.truncate(size)
            while f.tell() < size:  # re-hash the bytes held: the digest covers the whole payload
                h.update(f.read(min(CHUNK_BYTES, size - f.tell())))
        except BaseException:
            f.close()
            raise
    else:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp, f = Path(tmp_name), os.fdopen(fd, "wb")
    kept = False  # the bytes of a broken stream stay for a resume
    try:
        total = header.total_bytes
        with f:
            try:
                for msg in it:
                    if msg.WhichOneof("kind") != "data":
                        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "a second header inside the stream")
                    data = msg.data
                    size += len(data)
                    if size > total:
                        raise TransferError(
                            grpc.StatusCode.OUT_OF_RANGE, f"stream longer than the declared {total} bytes"
                        )
                    h.update(data)
                    f.write(data)
                if size != total:
                    raise TruncatedStream(size, total)
            except BaseException as exc:
                if resumable and _broken(exc):
                    f.flush()
                    os.fsync(f.fileno())
                    kept = True
                raise
            digest = h.hexdigest()
            if digest != header.sha256:
                raise TransferError(
                    grpc.StatusCode.DATA_LOSS,
                    f"SHA-256 mismatch: header says {header.sha256}, payload is {digest}",
                )
            f.flush()
            # The fsync (disk) and the parse (CPU) overlap: neither needs the other.
            syncer = threading.Thread(target=os.fsync, args=(f.fileno(),), name="fsync")
            syncer.start()
            try:
                check_payload(tmp.read_bytes())
            except ValueError as exc:
                raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, f"payload refused: {exc}") from exc
            finally:
                syncer.join()
        os.replace(tmp, dest)
        return Received(header=header, path=dest, size=size, sha256=digest)
    except BaseException:
        if not kept:
            tmp.unlink(missing_ok=True)
        raise


def model_stream(header: common_pb2.TransferHeader, path: Path, counter: list[int] | None = None) -> Iterator[common_pb2.ModelChunk]:
    """The messages of a model stream: the header, then the file in 1 MiB chunks.

    When ``counter`` is given, ``counter[0]`` accumulates the bytes put on the wire: each
    message's serialized size plus gRPC's 5-byte frame prefix.
    """
    msg = common_pb2.ModelChunk(header=header)
    if counter is not None:
        counter[0] += msg.ByteSize() + GRPC_FRAME_BYTES
    yield msg
    for block in iter_file_chunks(path):
        msg = common_pb2.ModelChunk(data=block)
        if counter is not None:
            counter[0] += msg.ByteSize() + GRPC_FRAME_BYTES
        yield msg


def encoded_model_stream(header: common_pb2.TransferHeader, path: Path, counter: list[int],
                         cancelled: Callable[[], bool] | None = None) -> Iterator[bytes]:
    """:func:`model_stream` already serialized (for an identity request serializer): the same
    bytes on the wire without building a protobuf message per chunk, from ``header.offset`` on.
    ``counter[0]`` accumulates the bytes put on the wire (messages plus gRPC's 5-byte frame
    prefix each). ``cancelled``, when given, is asked before each chunk: True ends the stream
    there, short of the payload's size (the receiver refuses it and keeps the bytes as a
    partial transfer, which its end notice removes)."""
    raw = common_pb2.ModelChunk(header=header).SerializeToString()
    counter[0] += len(raw) + GRPC_FRAME_BYTES
    yield raw
    for block in iter_file_chunks(path, start=header.offset):
        if cancelled is not None and cancelled():
            return
        raw = encode_data_chunk(block)
        counter[0] += len(raw) + GRPC_FRAME_BYTES
        yield raw


OFFSET_METHOD = "/fedrelay.v1.Peer/TransferOffset"


class SendCancelled(Exception):
    """``send_model``'s ``cancelled`` said stop: the stream was cut short at a chunk boundary."""


@dataclass
class Sent:
    receipt: object  # peer_pb2.HandoffReceipt
    payload_bytes: int
    wire_bytes: int   # bytes this call put on the wire (the offset query included, if it got through)
    started: float  # unix seconds
    ended: float
    resumed_from: int = 0  # payload bytes the receiver already held: the stream began there
    # How it went (peer/relaying.py): "direct", or "relayed" through the relay at ``relay`` as a
    # sealed envelope of ``sealed_bytes`` bytes with SHA-256 ``sealed_sha256``.
    route: str = "direct"
    relay: str = ""
    sealed_bytes: int = 0
    sealed_sha256: str = ""


# The calls a model stream makes: (offset query, stream, reply parser). A relay's Offset/Put have
# the same shapes as a peer's TransferOffset/Handoff (peer/relaying.py).
PEER_METHODS = (OFFSET_METHOD, HANDOFF_METHOD, peer_pb2.HandoffReceipt.FromString)


def send_model(address: str, header: common_pb2.TransferHeader, path: Path, timeout: float | None = None,
               *, transport=None, expect: str | None = None, resume: bool = True,
               counter: list[int] | None = None, cancelled: Callable[[], bool] | None = None,
               methods: tuple = PEER_METHODS) -> Sent:
    """Stream the model file at ``path`` to the peer at ``address`` (Peer.Handoff).

    ``header.total_bytes`` and ``header.sha256`` must describe the file. ``transport`` (a
    ``fedrelay.transport.Transport``; default plaintext) makes the channel, and with TLS ``expect``
    names the identity the receiver's certificate must carry. ``timeout`` defaults to
    ``calls.transfer_timeout(total_bytes)`` seconds. ``resume``: first ask the receiver how
    many bytes of this payload it holds from a broken earlier stream (``Peer.TransferOffset``;
    a receiver without that method counts as 0) and send only the rest. ``counter[0]``, when
    given, accumulates the bytes put on the wire, also by a call that fails. ``cancelled``,
    when given, is asked before each chunk; when it says True the stream ends there, short of the
    payload (the receiver refuses it as truncated), and :class:`SendCancelled` is raised. Raises ``grpc.RpcError``
    when the receiver refuses or cannot be reached. ``methods``: the (offset query, stream,
    reply parser) to use, by default the Peer service's (a relay's: ``peer.relaying``).
    """
    offset_method, stream_method, parse_reply = methods
    counter = counter if counter is not None else [0]
    before = counter[0]
    timeout = timeout if timeout is not None else transfer_timeout(header.total_bytes)
    started = time.time()
    channel = transport.channel(address, expect=expect) if transport is not None else insecure_channel(address)
    with channel:
        offset = 0
        if resume:
            query = channel.unary_unary(offset_method, request_serializer=common_pb2.TransferHeader.SerializeToString,
                                        response_deserializer=peer_pb2.TransferOffsetReply.FromString)
            try:
                held = query(header, timeout=CONTROL_TIMEOUT)
                if not held.complete and 0 < held.offset <= header.total_bytes:
                    offset = held.offset
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:  # it reached the receiver
                    counter[0] += header.ByteSize() + GRPC_FRAME_BYTES
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
            else:
                counter[0] += header.ByteSize() + GRPC_FRAME_BYTES
        if offset:
            resumed = common_pb2.TransferHeader()
            resumed.CopyFrom(header)
            resumed.offset = offset
            header = resumed
        handoff = channel.stream_unary(stream_method, request_serializer=None, response_deserializer=parse_reply)
        try:
            receipt = handoff(encoded_model_stream(header, path, counter, cancelled), timeout=timeout)
        except grpc.RpcError:
            if cancelled is not None and cancelled():  # the receiver refused the stream we cut short
                raise SendCancelled("the transfer was cancelled") from None
            raise
    return Sent(receipt, header.total_bytes, counter[0] - before, started, time.time(), offset)
