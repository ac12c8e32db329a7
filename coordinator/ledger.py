"""The ledger: the coordinator's only state, in SQLite.

Tables: ``peers`` (registrations), ``runs`` (one row per run, with its outcome), ``plans``
(every version of a run's transfer plan: version 0 as started, one more per reroute),
``hops`` (what the senders reported of each planned transfer, by purpose: ``chain`` hops,
``upload`` (a star plan's payloads to the aggregating site) and ``final`` copies, each with sender, receiver, payload bytes, bytes on the wire as counted by the
sender, SHA-256, schema digest, start and end times in unix seconds), ``receipts`` (what the
receivers attested of the same transfers: sender, bytes kept, SHA-256, schema digest; a transfer
is *done* only when both ends agree, :func:`transfer_status`), ``evaluations`` (per-site
accuracy of a run's final model),
``metrics`` (per-epoch training progress), ``events`` (the ordered log that ``WatchRun``
streams) and ``forgotten`` (registrations the operator removed, and the daemon instance each
had: ``coordinator/forgotten.py``). Writes are serialised by one lock; the file uses WAL so readers never block.

What makes the ledger auditable (``coordinator audit``, ``coordinator/audit.py``): each run's
events form a hash chain (``prev_hash``, ``hash``: ``coordinator/hashchain.py``); the sites'
signed reports and evaluations (``fedrelay/signing.py``) are kept in ``records`` (canonical
bytes, signature, the signer's certificate by fingerprint in ``certificates``), each bound into
the chain by the event it was recorded with (``events.record``: the binding digest); and when a
run ends, the coordinator's signed ``RunSeal`` of the chain's head, the run's row and its plan
versions goes into ``seals``.

This module holds :class:`Ledger`, the one object the rest of the coordinator keeps; each group
of tables is owned by a part of its own, which ``Ledger`` forwards to under the same method
names: the file, schema and migrations (``ledger_store.py``), registrations
(``ledger_peers.py``), runs, plans, skips and end notices (``ledger_runs.py``), transfers
(``ledger_transfers.py``), evaluations and metrics (``ledger_results.py``) and the event log
with its hash chain, records and seals (``ledger_events.py``).
"""


from __future__ import annotations

import functools
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable

from fedrelay import signing
from fedrelay.coordinator.ledger_events import EventLog
from fedrelay.coordinator.ledger_peers import LAST_SEEN_FLUSH, PeerRegistry
from fedrelay.coordinator.ledger_results import Results
from fedrelay.coordinator.ledger_runs import TERMINAL, RunRecords
from fedrelay.coordinator.ledger_store import SCHEMA, LedgerError, Store
from fedrelay.coordinator.ledger_transfers import SENDER_SIDE, LedgerConflict, TransferRecords, transfer_status

__all__ = ["LAST_SEEN_FLUSH", "SCHEMA", "SENDER_SIDE", "TERMINAL", "Ledger", "LedgerConflict", "LedgerError",
           "transfer_status"]


def _forward(part: str, method: Callable) -> Callable:
    """A ``Ledger`` method that calls ``method`` (same name, signature and docstring) on the
    ledger's part named ``part``."""
    name = method.__name__

    @functools.wraps(method)
    def forward(self, *args, **kwargs):
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return forward


class Ledger:
    """Thread-safe access to the SQLite ledger at ``path`` (``":memory:"`` for tests).

    Its parts, one per group of tables, share one connection and lock (``store``):
    ``peer_registry`` (:class:`PeerRegistry`), ``run_records`` (:class:`RunRecords`),
    ``transfers`` (:class:`TransferRecords`), ``results`` (:class:`Results`) and ``event_log``
    (:class:`EventLog`); the methods below are theirs.

    Raises ``LedgerError`` when ``path`` is a folder, not an SQLite database, or not writable
    (with its folder), before anything is served."""

    def __init__(self, path: str | Path):
        self.store = Store(path)
        self._db: sqlite3.Connection = self.store.db
        self._lock: threading.RLock = self.store.lock
        self.event_log = EventLog(self.store)
        self.peer_registry = PeerRegistry(self.store, self.event_log.batch)
        self.run_records = RunRecords(self.store, self.event_log)
        self.transfers = TransferRecords(self.store)
        self.results = Results(self.store)
        self.on_run_ended: list = self.run_records.on_run_ended  # callables (run_id, status, error), after a run ended
        self.on_event: list = self.event_log.on_event  # callables (event row), under the lock, once committed

    @property
    def sealer(self) -> Callable[[Any], signing.SignedRecord]:
        """Signs a run's RunSeal when it ends (the coordinator's key); unsigned by default."""
        return self.event_log.sealer

    @sealer.setter
    def sealer(self, sign: Callable[[Any], signing.SignedRecord]) -> None:
        self.event_log.sealer = sign

    @property
    def last_seen_flush(self) -> float:
        """Seconds a heartbeat's ``last_seen`` may stay in memory only (``upsert_peer``)."""
        return self.peer_registry.last_seen_flush

    @last_seen_flush.setter
    def last_seen_flush(self, seconds: float) -> None:
        self.peer_registry.last_seen_flush = seconds

    def close(self) -> None:
        """Write the heartbeats kept in memory, then close the file."""
        with self._lock:
            self.flush_last_seen()
            self.store.close()

    @property
    def lock(self) -> threading.RLock:
        """The ledger's (re-entrant) lock: held, nothing is written or published meanwhile."""
        return self._lock

    # -- registrations (ledger_peers.py) ---------------------------------------------------------
    upsert_peer = _forward("peer_registry", PeerRegistry.upsert_peer)
    flush_last_seen = _forward("peer_registry", PeerRegistry.flush_last_seen)
    peer = _forward("peer_registry", PeerRegistry.peer)
    peers = _forward("peer_registry", PeerRegistry.peers)
    last_seen = _forward("peer_registry", PeerRegistry.last_seen)
    registered_count = _forward("peer_registry", PeerRegistry.registered_count)
    set_peer_instance = _forward("peer_registry", PeerRegistry.set_peer_instance)
    forget_peer = _forward("peer_registry", PeerRegistry.forget_peer)
    forgotten = _forward("peer_registry", PeerRegistry.forgotten)
    unforget = _forward("peer_registry", PeerRegistry.unforget)

    # -- runs, plans, skips and end notices (ledger_runs.py) ------------------------------------
    create_run = _forward("run_records", RunRecords.create_run)
    plans = _forward("run_records", RunRecords.plans)
    reroute = _forward("run_records", RunRecords.reroute)
    run = _forward("run_records", RunRecords.run)
    running_run_ids = _forward("run_records", RunRecords.running_run_ids)
    run_ids = _forward("run_records", RunRecords.run_ids)
    run_counts = _forward("run_records", RunRecords.run_counts)
    update_run = _forward("run_records", RunRecords.update_run)
    finish_run = _forward("run_records", RunRecords.finish_run)
    cancel_run = _forward("run_records", RunRecords.cancel_run)
    refuse_run = _forward("run_records", RunRecords.refuse_run)
    add_skip = _forward("run_records", RunRecords.add_skip)
    skips = _forward("run_records", RunRecords.skips)
    pending_end_notices = _forward("run_records", RunRecords.pending_end_notices)
    end_notice_delivered = _forward("run_records", RunRecords.end_notice_delivered)

    # -- transfers (ledger_transfers.py) ---------------------------------------------------------
    record_hop = _forward("transfers", TransferRecords.record_hop)
    record_receipt = _forward("transfers", TransferRecords.record_receipt)
    hops = _forward("transfers", TransferRecords.hops)
    transfer = _forward("transfers", TransferRecords.transfer)
    transfer_totals = _forward("transfers", TransferRecords.transfer_totals)

    # -- evaluations and metrics (ledger_results.py) ---------------------------------------------
    record_evaluation = _forward("results", Results.record_evaluation)
    evaluations = _forward("results", Results.evaluations)
    recent_results = _forward("results", Results.recent_results)
    record_metric = _forward("results", Results.record_metric)
    metrics = _forward("results", Results.metrics)

    # -- events, the hash chain and seals (ledger_events.py) -------------------------------------
    batch = _forward("event_log", EventLog.batch)
    add_event = _forward("event_log", EventLog.add_event)
    last_event_seq = _forward("event_log", EventLog.last_event_seq)
    events_after = _forward("event_log", EventLog.events_after)
    wait_for_events = _forward("event_log", EventLog.wait_for_events)
