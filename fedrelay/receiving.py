"""Receiving a model stream into a file, as both daemons do: a site's ``Peer.Handoff`` and its
fetch of a relayed envelope (``fedrelay.peer``), and the relay's ``Relay.Put``
(``fedrelay.coordinator.relay_server``).

A model stream is one ``TransferHeader`` followed by the safetensors payload in chunks of at most
``fedrelay.calls.CHUNK_BYTES``. :func:`receive_model`

1. checks the header (:func:`check_header_fields`, then the caller's ``check_header``: known
   run, expected sender and hop, size under the cap),
2. writes the chunks to a temporary file beside the destination while updating SHA-256
   (so hashing overlaps the transfer), refusing a stream longer than declared,
3. refuses a truncated stream or a digest mismatch,
4. parses the tensors with safetensors only (``check_payload``: names, shapes, dtypes, finite)
   while the file is fsynced,
5. and only then renames the file into place.

Any refusal removes the temporary file: nothing is left on disk. Refusals are ``TransferError``
carrying the gRPC status code to answer with.

Resuming: with ``resumable=True`` the temporary file has a fixed name per (destination,
SHA-256), :func:`partial_path`. A stream that *breaks* after its header was accepted (the call
was cancelled or cut, it ended short of the declared size, the sender stalled, or a newer stream
of the same transfer superseded it) leaves that file in place, fsynced; the sender asks how much
is held (``Peer.TransferOffset``, :func:`held_bytes`) and sends the rest with
``TransferHeader.offset``. The receiver re-hashes the bytes it holds, so the SHA-256 check still
covers the whole payload. A refused stream (a bad header, more bytes than declared, a digest
mismatch, a payload that is not the run's model) still leaves nothing. At most one partial file
exists per destination: a stream for another digest removes the older one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import grpc

from fedrelay import names
from fedrelay.calls import CHUNK_BYTES
from fedrelay.v1 import common_pb2


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
