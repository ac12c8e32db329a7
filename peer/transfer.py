"""Moving a model between peers: chunked streams, size and digest checks, validation.

A model stream is one ``TransferHeader`` followed by the safetensors payload in chunks of at most
``fedrelay.wire.CHUNK_BYTES``. The receiver

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
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc

from fedrelay import wire
from fedrelay.v1 import common_pb2, peer_pb2

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
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
        "Reroute": grpc.unary_unary_rpc_method_handler(
            servicer.Reroute, request_deserializer=peer_pb2.RerouteRequest.FromString,
            response_serializer=peer_pb2.RerouteReply.SerializeToString),
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
    size: int  # bytes
    sha256: str


def receive_model(
    chunks: Iterable[common_pb2.ModelChunk],
    dest: Path,
    check_header: Callable[[common_pb2.TransferHeader], Path | None],
    check_payload: Callable[[bytes], None],
) -> Received:
    """Receive a model stream into ``dest`` (or where ``check_header`` says).

    ``check_header(header)`` raises ``TransferError`` to refuse before any byte is written; it
    may return another destination path. ``check_payload(data)`` raises ``ValueError`` when the
    safetensors content does not fit the run. Raises ``TransferError``:
    INVALID_ARGUMENT (no header first, a second header, malformed payload), OUT_OF_RANGE (longer
    than declared), DATA_LOSS (truncated, SHA-256 mismatch), or whatever ``check_header`` raises.
    """
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: expected a header") from None
    if first.WhichOneof("kind") != "header":
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a header")
    header = first.header
    if not _SHA256_RE.match(header.sha256):
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "header.sha256 must be 64 lowercase hex digits")
    if header.total_bytes == 0:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "header.total_bytes must be > 0")
    dest = check_header(header) or dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        size = 0
        total = header.total_bytes
        with os.fdopen(fd, "wb") as f:
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
                raise TransferError(
                    grpc.StatusCode.DATA_LOSS, f"truncated stream: {size} of {total} declared bytes"
                )
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
    for block in wire.iter_file_chunks(path):
        msg = common_pb2.ModelChunk(data=block)
        if counter is not None:
            counter[0] += msg.ByteSize() + GRPC_FRAME_BYTES
        yield msg


def encoded_model_stream(header: common_pb2.TransferHeader, path: Path, counter: list[int]) -> Iterator[bytes]:
    """:func:`model_stream` already serialized (for an identity request serializer): the same
    bytes on the wire without building a protobuf message per chunk. ``counter[0]`` accumulates
    the bytes put on the wire (messages plus gRPC's 5-byte frame prefix each)."""
    raw = common_pb2.ModelChunk(header=header).SerializeToString()
    counter[0] += len(raw) + GRPC_FRAME_BYTES
    yield raw
    for block in wire.iter_file_chunks(path):
        raw = encode_data_chunk(block)
        counter[0] += len(raw) + GRPC_FRAME_BYTES
        yield raw


@dataclass
class Sent:
    receipt: object  # peer_pb2.HandoffReceipt
    payload_bytes: int
    wire_bytes: int
    started: float  # unix seconds
    ended: float


def send_model(address: str, header: common_pb2.TransferHeader, path: Path, timeout: float | None = None,
               *, transport=None, expect: str | None = None) -> Sent:
    """Stream the model file at ``path`` to the peer at ``address`` (Peer.Handoff).

    ``header.total_bytes`` and ``header.sha256`` must describe the file. ``transport`` (a
    ``fedrelay.wire.Transport``; default plaintext) makes the channel, and with TLS ``expect``
    names the identity the receiver's certificate must carry. ``timeout`` defaults to
    ``wire.transfer_timeout(total_bytes)`` seconds. Raises ``grpc.RpcError`` when the receiver
    refuses or cannot be reached.
    """
    counter = [0]
    timeout = timeout if timeout is not None else wire.transfer_timeout(header.total_bytes)
    started = time.time()
    channel = transport.channel(address, expect=expect) if transport is not None else wire.insecure_channel(address)
    with channel:
        handoff = channel.stream_unary(HANDOFF_METHOD, request_serializer=None,
                                       response_deserializer=peer_pb2.HandoffReceipt.FromString)
        receipt = handoff(encoded_model_stream(header, path, counter), timeout=timeout)
    return Sent(receipt, header.total_bytes, counter[0], started, time.time())
