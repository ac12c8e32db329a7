"""Moving a model between peers: chunked streams, size and digest checks, validation.

A model stream is one ``TransferHeader`` followed by the safetensors payload in chunks of at most
``fedrelay.wire.CHUNK_BYTES``. The receiver

1. checks the header (via the caller's ``check_header``: known run, expected sender and hop,
   size under the cap),
2. writes the chunks to a temporary file beside the destination while updating SHA-256
   (so hashing overlaps the transfer), refusing a stream longer than declared,
3. refuses a truncated stream or a digest mismatch,
4. parses the tensors with safetensors only (``check_payload``: names, shapes, dtypes, finite),
5. and only then fsyncs and renames the file into place.

Any refusal removes the temporary file: nothing is left on disk. Refusals are ``TransferError``
carrying the gRPC status code to answer with.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc

from fedrelay import wire
from fedrelay.v1 import common_pb2, peer_pb2_grpc

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message framing: 1 flag byte + 4 length bytes


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
            os.fsync(f.fileno())
        try:
            check_payload(tmp.read_bytes())
        except ValueError as exc:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, f"payload refused: {exc}") from exc
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


@dataclass
class Sent:
    receipt: object  # peer_pb2.HandoffReceipt
    payload_bytes: int
    wire_bytes: int
    started: float  # unix seconds
    ended: float


def send_model(address: str, header: common_pb2.TransferHeader, path: Path, timeout: float | None = None) -> Sent:
    """Stream the model file at ``path`` to the peer at ``address`` (Peer.Handoff).

    ``header.total_bytes`` and ``header.sha256`` must describe the file. Raises
    ``grpc.RpcError`` when the receiver refuses or cannot be reached.
    """
    counter = [0]
    timeout = timeout if timeout is not None else wire.transfer_timeout(header.total_bytes)
    started = time.time()
    with wire.insecure_channel(address) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        receipt = stub.Handoff(model_stream(header, path, counter), timeout=timeout)
    return Sent(receipt, header.total_bytes, counter[0], started, time.time())
