"""Refused inbound streams of a planned sender, counted instead of logged one by one.

A Handoff stream whose header names a transfer of the run's plan, from its planned sender,
turns the run's state to "receiving" (a log line, and a progress report the coordinator writes
to the ledger as an event) and back when the stream fails (another line and event). A sender
that opens stream after stream and never completes one (a broken or hostile site) would write
two log lines and two ledger events per stream, without bound. :class:`RefusedStreams` counts
the failed streams per (run, sender): the first ``ANNOUNCED`` are reported like any stream;
after them that sender's streams change the run's state silently (no log line, no report), and
one line says so. The next stream of that sender that is accepted, or the run's end, writes one
line with the number refused.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("fedrelay.peer")

ANNOUNCED = 3  # failed streams of one (run, sender) whose state changes are logged and reported


class RefusedStreams:
    """Failed Handoff streams per (run id, sender). Thread-safe."""

    def __init__(self, announced: int = ANNOUNCED):
        self.announced = announced
        self._failed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def loud(self, run_id: str, sender: str) -> bool:
        """Whether the state changes of a new stream from ``sender`` in ``run_id`` are logged
        and reported: True until ``announced`` of its streams have failed."""
        with self._lock:
            return self._failed.get((run_id, sender), 0) < self.announced

    def failed(self, run_id: str, sender: str) -> None:
        """A stream from ``sender`` in ``run_id`` failed after its header was accepted."""
        with self._lock:
            n = self._failed[(run_id, sender)] = self._failed.get((run_id, sender), 0) + 1
        if n == self.announced:
            log.warning("run %s: %d streams from %s failed; its next streams are counted, not logged or reported "
                        "one by one", run_id, n, sender)

    def accepted(self, run_id: str, sender: str) -> None:
        """A stream from ``sender`` in ``run_id`` was accepted: the count starts again (one line
        when streams were counted silently)."""
        with self._lock:
            n = self._failed.pop((run_id, sender), 0)
        if n > self.announced:
            log.warning("run %s: %d streams from %s failed before this one was accepted", run_id, n, sender)

    def forget(self, run_id: str) -> None:
        """The run ended: one line per sender whose streams were counted silently."""
        with self._lock:
            counts = {k: n for k, n in self._failed.items() if k[0] == run_id}
            for k in counts:
                del self._failed[k]
        for (_, sender), n in sorted(counts.items()):
            if n > self.announced:
                log.warning("run %s: %d streams from %s failed in all", run_id, n, sender)
