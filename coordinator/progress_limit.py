"""Progress reports rate-limited per run member: a token bucket per (run, site).

A site reports a state change or an epoch's metrics a few times a minute; a run member that
sends thousands a second (the hostile trial: 2,000 reports of 16 KB in 2.7 s, +62 MiB of ledger)
would fill the ledger and the coordinator's disk. :class:`ProgressLimit` gives each (run, site)
a bucket of ``burst`` reports that refills at ``rate`` reports per second; a report that finds
its bucket empty is dropped (the caller answers it as a duplicate: nothing recorded, the site is
not told to retry). Dropping writes one log line for the (run, site) when it starts, then at
most one summary line per ``log_window`` seconds with the number dropped (written with the next
report of that member after the window).

The default (``burst`` 256, ``rate`` 8 per second) is far above a real site's pace (one report
per epoch and per state change) and bounds a hostile member to about 8 ledger rows a second.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("fedrelay.coordinator.progress")

DEFAULT_BURST = 256
DEFAULT_RATE = 8.0  # reports per second


class ProgressLimit:
    """Token buckets of progress reports, one per (run, site). Thread-safe.

    ``burst``: reports a member may send at once (the bucket's size, >= 1); ``rate``: reports
    per second the bucket refills (> 0); ``clock``: a monotonic clock in seconds (tests pass
    their own). Raises ``ValueError`` for a bound that is not positive.
    """

    def __init__(self, burst: int = DEFAULT_BURST, rate: float = DEFAULT_RATE, *, log_window: float = 60.0,
                 clock=time.monotonic, logger: logging.Logger = log):
        if burst < 1 or not rate > 0:
            raise ValueError(f"progress limit: burst must be >= 1 and rate > 0 (got {burst}, {rate})")
        self.burst, self.rate, self.log_window = burst, float(rate), log_window
        self.clock, self.logger = clock, logger
        self._lock = threading.Lock()
        # (run, site) -> [tokens, last refill time, dropped since the last log line, time of that line or None]
        self._buckets: dict[tuple[str, str], list] = {}

    def admit(self, run_id: str, site: str) -> bool:
        """Take one token of (``run_id``, ``site``): True when the report may be recorded,
        False when it is to be dropped (and counted for the log)."""
        now = self.clock()
        line = None
        with self._lock:
            b = self._buckets.get((run_id, site))
            if b is None:
                b = self._buckets[(run_id, site)] = [float(self.burst), now, 0, None]
            b[0] = min(float(self.burst), b[0] + (now - b[1]) * self.rate)
            b[1] = now
            if b[0] >= 1.0:
                b[0] -= 1.0
                ok = True
            else:
                ok = False
                b[2] += 1
            if b[3] is None and not ok:
                b[3], b[2] = now, 0
                line = (f"run {run_id}: progress reports from {site} exceed {self.burst} at once or "
                        f"{self.rate:g} a second; dropping the excess (summed up once a {self.log_window:g} s window)")
            elif b[3] is not None and b[2] and now >= b[3] + self.log_window:
                line = f"run {run_id}: dropped {b[2]} progress reports from {site} in the last {now - b[3]:.0f} s"
                b[3], b[2] = now, 0
        if line is not None:
            self.logger.warning(line)
        return ok

    def forget(self, run_id: str) -> None:
        """Drop the buckets of an ended run (its members report nothing more)."""
        with self._lock:
            for key in [k for k in self._buckets if k[0] == run_id]:
                del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)
