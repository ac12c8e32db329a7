"""Inbound model streams: at most one stream writes into a destination, and none hangs.

A site's ``Peer.Handoff`` (``fedrelay.peer``) and the relay's ``Relay.Put``
(``fedrelay.coordinator.relay_server``) check a transfer against the run's plan; this module keeps the
streams they accepted: a newer stream of the same transfer (the sender resumed after a link dropped without
a reset) ends the older one, keeping its bytes (``claim``/``end``); a stream that sends nothing
for ``stall_timeout`` seconds, or runs past ``calls.transfer_timeout`` of its declared size, is
dropped (``watched``).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import grpc

from fedrelay.calls import transfer_timeout
from fedrelay.receiving import TransferError


class Stream:
    """One open Handoff stream into a destination: ``cancel`` asks it to end (keeping its
    bytes); ``done`` is set once it has."""

    def __init__(self):
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.dest: Path | None = None


class InboundStreams:
    """The Handoff streams open at one daemon, by destination file."""

    def __init__(self, stall_timeout: float):
        if stall_timeout <= 0:
            raise ValueError("the stall timeout must be > 0 seconds")
        self.stall_timeout = stall_timeout  # seconds without a message before a stream is dropped
        self._by_dest: dict[Path, Stream] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many streams are open now."""
        with self._lock:
            return len(self._by_dest)

    def end(self, dest: Path, wait: float = 10.0) -> None:
        """Close the stream into ``dest`` still open here, if any; its bytes are kept. Raises
        ``TransferError`` (ABORTED: retry) when it does not close within ``wait`` seconds."""
        with self._lock:
            old = self._by_dest.get(dest)
        if old is not None:
            old.cancel.set()
            if not old.done.wait(wait):
                raise TransferError(grpc.StatusCode.ABORTED, "an older stream of this transfer is still closing; retry")

    def claim(self, dest: Path, mine: Stream) -> None:
        """Make ``mine`` the one stream writing into ``dest``: an older one (its sender gave up on
        it, e.g. after a link dropped) is ended first, keeping its bytes."""
        while True:
            self.end(dest)
            with self._lock:
                if dest not in self._by_dest:
                    self._by_dest[dest] = mine
                    mine.dest = dest
                    return

    def release(self, mine: Stream) -> None:
        with self._lock:
            if mine.dest is not None and self._by_dest.get(mine.dest) is mine:
                del self._by_dest[mine.dest]
        mine.done.set()

    def watched(self, chunks, cancel: threading.Event | None = None):
        """``chunks``, read by a helper thread, with a watchdog: raises ``TransferError``
        (DEADLINE_EXCEEDED) when no message comes for ``stall_timeout`` seconds, or when the
        stream runs past ``calls.transfer_timeout`` of its declared size; ABORTED soon after
        ``cancel`` is set (a newer stream of the same transfer took over)."""
        q: queue.Queue = queue.Queue(maxsize=4)
        done = threading.Event()
        end = object()

        def put(item) -> None:  # waits while the queue is full, until the reader is done
            while not done.is_set():
                try:
                    q.put(item, timeout=0.5)
                    return
                except queue.Full:
                    continue

        def pump() -> None:
            item = end
            try:
                for msg in chunks:
                    put(msg)
                    if done.is_set():
                        return
            except BaseException as exc:  # noqa: BLE001 - the call ended (cancelled, broken)
                item = exc
            put(item)

        threading.Thread(target=pump, name="handoff-reader", daemon=True).start()
        deadline = None
        last = time.monotonic()
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise TransferError(grpc.StatusCode.ABORTED, "stream ended: a newer stream of this transfer took over")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "stream dropped: slower than the transfer deadline")
                if now >= last + self.stall_timeout:
                    raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"stream dropped: the sender stalled (nothing for {self.stall_timeout:g} s)")
                limit = last + self.stall_timeout if deadline is None else min(deadline, last + self.stall_timeout)
                try:
                    item = q.get(timeout=max(0.0, min(0.25, limit - now)))
                except queue.Empty:
                    continue
                last = time.monotonic()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                if deadline is None and item.WhichOneof("kind") == "header":
                    deadline = time.monotonic() + transfer_timeout(item.header.total_bytes)
                yield item
        finally:
            done.set()
