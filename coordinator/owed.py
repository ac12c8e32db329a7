"""What the coordinator owes the sites and has not delivered yet, shared by the modules that
queue it and those that send it: reroutes (``routing``), end notices' next tries and relay
notices (``notices``), the receivers told to prepare (``reports``), and the condition every
receipt notifies (``evaluation`` waits on it for relayed final copies)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fedrelay.v1 import peer_pb2


@dataclass
class Owed:
    """Owed messages and their lock. ``reroutes``: (run, site) -> the ``RerouteRequest`` to
    deliver; ``end_retry``: (run, site) -> monotonic time of the next try of its end notice;
    ``relay_notices``: (run, purpose word, index, receiver) -> [notice, monotonic time of the
    next try]; ``prepared``: chain hops (run, hop) whose outbound-only receiver was told to
    prepare. ``lock`` guards ``relay_notices`` and ``prepared``."""

    reroutes: dict[tuple[str, str], peer_pb2.RerouteRequest] = field(default_factory=dict)
    end_retry: dict[tuple[str, str], float] = field(default_factory=dict)
    relay_notices: dict[tuple[str, str, int, str], list] = field(default_factory=dict)
    prepared: set[tuple[str, int]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    receipts: threading.Condition = field(default_factory=threading.Condition)

    def tunnel_opened(self, site: str) -> None:
        """A site's control stream (re)opened: what it is owed goes out at the next tick."""
        with self.lock:
            for key, entry in self.relay_notices.items():
                if key[3] == site:
                    entry[1] = 0.0
        for key in [k for k in list(self.end_retry) if k[1] == site]:
            self.end_retry.pop(key, None)

    def receipt(self, run_id: str, purpose: str, index: int, receiver: str) -> None:
        """A receiver attested a transfer: its relay notice is no longer owed; wake the waiters."""
        with self.lock:
            self.relay_notices.pop((run_id, purpose, index, receiver), None)
        with self.receipts:
            self.receipts.notify_all()
