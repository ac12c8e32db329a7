"""The peer's calls to the coordinator: one channel, one retry policy, and the two reporters.

- :class:`CoordinatorLink`: the one channel to the coordinator (whose certificate must name
  ``coordinator`` under TLS), reused by every call, retried with ``calls.backoff_delays`` (the
  one retry policy of both daemons). Under TLS its reports for the ledger (``ReportHop``,
  ``ReportReceipt``, ``ReportFinal``, ``ReportFailure``) are signed with the site's key
  (``fedrelay.signing.SigningStub``) on every call.
- :class:`Reporter`: two background threads. Progress (epochs, state changes) is best effort and
  never blocks the caller: one try of up to 5 s each, dropped when :data:`PROGRESS_QUEUE` reports
  wait. Receipts (what this site verified and kept, ``Coordinator.ReportReceipt``) must reach the
  ledger: each is retried until the coordinator answers; the caller persists them and hands them
  again after a restart. A thread that hits an unexpected error logs it and goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import grpc

from fedrelay import signing
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import CONTROL_TIMEOUT, backoff_delays, status_message
from fedrelay.transport import INSECURE, Transport
from fedrelay.v1 import coordinator_pb2_grpc

log = logging.getLogger("fedrelay.peer")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
PROGRESS_QUEUE = 1000  # progress reports a peer holds while the coordinator is slow or unreachable


class CoordinatorLink:
    """The peer's calls to the coordinator over one channel. Reports are retried until
    ``retry_for`` seconds pass."""

    def __init__(self, address: str, transport: Transport = INSECURE):
        self.address = address
        self.transport = transport
        self.last_registered = 0.0  # unix seconds the coordinator last took this site's registration
        self.registration_error = ""  # why the latest registration failed ("" after a success)
        self.relay = ""  # the relay the coordinator names (RegisterReply.relay; "": the coordinator itself)
        self._channel = transport.channel(address, expect=COORDINATOR_IDENTITY)
        self.stub = signing.SigningStub(coordinator_pb2_grpc.CoordinatorStub(self._channel),
                                        signing.signer_for(transport))

    def call(self, method: str, request, *, retry_for: float = 0.0, stop: threading.Event | None = None,
             timeout: float = CONTROL_TIMEOUT):
        """Call ``method`` with ``request``; retry retryable failures (backoff_delays) for up to
        ``retry_for`` seconds, or until ``stop`` is set. Raises the last ``grpc.RpcError``."""
        deadline = time.monotonic() + retry_for
        for delay in backoff_delays():
            try:
                return getattr(self.stub, method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() + delay > deadline:
                    raise
                log.warning("coordinator %s: %s failed (%s); retrying", self.address, method, status_message(exc))
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):
                    raise

    def close(self) -> None:
        self._channel.close()


class Reporter:
    """Background delivery of progress (best effort) and receipts (retried until delivered)."""

    def __init__(self, link: CoordinatorLink | None, stop: Callable[[], threading.Event]):
        self.link = link
        self._stop = stop  # the daemon's stop event (it may be replaced after construction)
        self._progress: queue.Queue = queue.Queue(maxsize=PROGRESS_QUEUE)
        self._receipts: queue.Queue = queue.Queue()
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def progress(self, report) -> None:
        """Queue a ``ProgressReport``; never blocks (dropped, at debug level, when the queue is full)."""
        if self.link is None:
            return
        try:
            self._progress.put_nowait(report)
        except queue.Full:
            log.debug("progress report dropped: %d reports are waiting", PROGRESS_QUEUE)
            return
        self._ensure("progress", self._progress_loop)

    def receipt(self, report, on_delivered: Callable[[], None]) -> None:
        """Queue a ``ReceiptReport``; ``on_delivered()`` runs once the coordinator took it (or
        refused it for good: the refusal is logged)."""
        if self.link is None:
            return
        self._receipts.put((report, on_delivered))
        self._ensure("receipts", self._receipt_loop)

    def _ensure(self, name: str, target) -> None:
        with self._lock:
            if name not in self._threads:
                self._threads[name] = threading.Thread(target=self._guarded, args=(name, target),
                                                       name=name, daemon=True)
                self._threads[name].start()

    def _guarded(self, name: str, target) -> None:
        while True:
            try:
                target()
                return
            except Exception:  # noqa: BLE001 - say so, and keep reporting
                log.exception("the %s reporter failed; restarting it", name)
                time.sleep(1.0)

    def _progress_loop(self) -> None:
        while True:
            report = self._progress.get()
            try:
                self.link.stub.ReportProgress(report, timeout=5.0)
            except grpc.RpcError as exc:
                log.debug("progress report lost: %s", status_message(exc))
            finally:
                self._progress.task_done()

    def _receipt_loop(self) -> None:
        while True:
            report, on_delivered = self._receipts.get()
            while True:
                try:
                    self.link.call("ReportReceipt", report, retry_for=600, stop=self._stop())
                except grpc.RpcError as exc:
                    if exc.code() in RETRYABLE and not self._stop().is_set():
                        continue  # keep trying: the ledger must have it
                    if exc.code() not in RETRYABLE:
                        log.error("the coordinator refused the receipt of run %s transfer %d: %s",
                                  report.run_id, report.hop, status_message(exc))
                        on_delivered()
                    break
                on_delivered()
                break
