"""Moving a model between peers: chunked streams sent, and the Peer service's registration.

A model stream is one ``TransferHeader`` followed by the safetensors payload in chunks of at most
``fedrelay.calls.CHUNK_BYTES``; the receiving side (header checks, digest, payload check,
partial files for resuming, ``TransferError``) is ``fedrelay.receiving``, which the relay of
the coordinator uses too.

Speed: data chunks are decoded without protobuf copies (``decode_chunk``) and sent
pre-serialized (``encoded_model_stream``); the wire format is the one ``proto/`` defines.

Resuming: the sender asks how much the receiver holds of a broken earlier stream
(``Peer.TransferOffset``) and sends the rest with ``TransferHeader.offset``
(``fedrelay.receiving``'s module docstring).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
from google.protobuf import message_factory

from fedrelay.calls import CONTROL_TIMEOUT, transfer_timeout
from fedrelay.files import iter_file_chunks
from fedrelay.guard import HANDOFF_METHOD
from fedrelay.transport import insecure_channel
from fedrelay.v1 import common_pb2, peer_pb2

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message framing: 1 flag byte + 4 length bytes


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


# One gRPC handler factory per (client streaming, server streaming) shape of a method.
_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_peer_servicer(servicer, server) -> None:
    """Register a Peer servicer like the generated ``add_PeerServicer_to_server`` (a handler for
    every method of the service, as its descriptor in ``peer.proto`` declares it), but with
    :func:`decode_chunk` as ``Handoff``'s request deserializer (the zero-copy receive path)."""
    handlers = {}
    for method in peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods:
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        handler = _HANDLERS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = handler(getattr(servicer, method.name),
                                        request_deserializer=decode_chunk if method.name == "Handoff" else request.FromString,
                                        response_serializer=reply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fedrelay.v1.Peer", handlers),))
    server.add_registered_method_handlers("fedrelay.v1.Peer", handlers)


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
    # How it went (peer/relay_client.py): "direct", or "relayed" through the relay at ``relay`` as a
    # sealed envelope of ``sealed_bytes`` bytes with SHA-256 ``sealed_sha256``.
    route: str = "direct"
    relay: str = ""
    sealed_bytes: int = 0
    sealed_sha256: str = ""


# The calls a model stream makes: (offset query, stream, reply parser). A relay's Offset/Put have
# the same shapes as a peer's TransferOffset/Handoff (peer/relay_client.py).
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
    reply parser) to use, by default the Peer service's (a relay's: ``peer.relay_client``).
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
