"""The runs' event logs in the ledger, their hash chain, the signed records bound into it and
the coordinator's seals.

:class:`EventLog` appends each event to its run's hash chain (``prev_hash``, ``hash``:
``coordinator/hashchain.py``), keeps the signed report or evaluation recorded with it in
``records`` (its certificate once, by fingerprint, in ``certificates``), writes a run's signed
``RunSeal`` into ``seals`` when it ends (:meth:`EventLog.seal`, from ``finish_run``), groups
writes into one transaction (:meth:`EventLog.batch`) and hands committed events to the
listeners (``on_event``) and to ``wait_for_events``.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

from fedrelay import signing
from fedrelay.coordinator import hashchain
from fedrelay.coordinator.ledger_store import Store


class EventLog:
    """The ``events``, ``records``, ``certificates`` and ``seals`` tables of the ledger in
    ``store``; ``changed`` (a condition on the store's lock) is notified on each published
    event."""

    def __init__(self, store: Store):
        self._store = store
        self._db = store.db
        self._lock = store.lock
        self.changed = threading.Condition(store.lock)
        self.on_event: list = []  # callables (event row), under the lock, once the event is committed
        # Signs a run's RunSeal when it ends (the coordinator's key); unsigned by default.
        self.sealer: Callable[[Any], signing.SignedRecord] = lambda seal: signing.unsigned("coordinator", seal)
        self._in_batch = False
        self._deferred: list[dict] = []  # events of the open batch, published at its commit
        self._heads: dict[str, str] = {}  # run id -> the hash of its latest event (read once per run)

    @contextmanager
    def batch(self):
        """Group the writes made inside (``add_event``, ``record_hop``, ``record_receipt``,
        ``record_metric``, ``update_run``; not the methods that open their own transaction) into
        one transaction: one commit (one fsync) instead of one per write. Events are published
        (``on_event``) after the commit; nothing is when the block raises (rolled back)."""
        with self._lock:
            if self._in_batch:
                yield
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._in_batch = True
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._deferred.clear()
                self._heads.clear()  # an event of the batch may have moved a run's head: read again
                raise
            finally:
                self._in_batch = False
            published, self._deferred = self._deferred, []
            for event in published:
                self.publish(event)

    def publish(self, event: dict) -> None:
        """Hand a committed event to the listeners and wake ``wait_for_events`` (lock held)."""
        for listener in self.on_event:
            listener(event)
        self.changed.notify_all()

    def forget_head(self, run_id: str) -> None:
        """Drop the run's chain head kept in memory (its transaction rolled back): read it again."""
        self._heads.pop(run_id, None)

    def add_event(self, run_id: str, kind: str, message: str, site: str = "", *,
                  record: signing.SignedRecord | None = None, **data: Any) -> int:
        """Append an event to the run's log (and hash chain); returns its seq. ``record``: the
        signed report or evaluation this event records, kept in ``records`` and bound into the
        chain by this event. Listeners (``on_event``) get it once committed (at the end of a
        ``batch``)."""
        event = {"run_id": run_id, "time": time.time(), "kind": kind, "site": site, "message": message,
                 "data": json.dumps(data)}
        with self.changed:
            own = record is not None and not self._in_batch  # several rows: one transaction
            if own:
                self._db.execute("BEGIN IMMEDIATE")
            try:
                event["seq"] = self.append(event, record)
                if own:
                    self._db.execute("COMMIT")
            except BaseException:
                if own:
                    self._db.execute("ROLLBACK")
                    self.forget_head(run_id)
                raise
            if self._in_batch:
                self._deferred.append(event)
            else:
                self.publish(event)
            return event["seq"]

    def append(self, event: dict[str, Any], record: signing.SignedRecord | None) -> int:
        """Insert ``event`` (run_id, time, kind, site, message, data) linked to its run's previous
        event (``coordinator/hashchain.py``), and ``record`` with its certificate, bound to it;
        returns its seq. Lock held, inside the caller's transaction when ``record`` is given."""
        run_id = event["run_id"]
        prev = self._heads.get(run_id)
        if prev is None:  # once per run and ledger: then kept (no read per event)
            last = self._db.execute("SELECT hash FROM events WHERE run_id = ? ORDER BY seq DESC LIMIT 1",
                                    (run_id,)).fetchone()
            prev = last["hash"] if last is not None and last["hash"] else hashchain.genesis(run_id)
        binding = record.binding() if record is not None else ""
        digest = hashchain.event_hash(prev, {**event, "record": binding})
        seq = int(self._db.execute(
            "INSERT INTO events (run_id, time, kind, site, message, data, prev_hash, hash, record) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*(event[k] for k in ("run_id", "time", "kind", "site", "message", "data")), prev, digest, binding),
        ).lastrowid)
        if record is not None:
            fp = self._keep_certificate(record, event["time"])
            self._db.execute("INSERT INTO records (run_id, seq, type, signer, record, signature, certificate) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (run_id, seq, record.type, record.signer, record.record, record.signature, fp))
        self._heads[run_id] = digest
        return seq

    def _keep_certificate(self, record: signing.SignedRecord, now: float) -> str:
        """Store the record's certificate once (by fingerprint); returns the fingerprint ("" for
        an unsigned record)."""
        if not record.certificate:
            return ""
        cert = signing.load_certificate(record.certificate)
        fp = signing.fingerprint(cert)
        self._db.execute("INSERT OR IGNORE INTO certificates (sha256, name, pem, first_seen) VALUES (?, ?, ?, ?)",
                         (fp, signing.common_name(cert), record.certificate.decode("ascii"), now))
        return fp

    def seal(self, run_id: str, now: float) -> None:
        """Write the run's ``RunSeal`` (signed by ``sealer``): its chain's head and length, its
        row (``hashchain.sealed_run``) and the SHA-256 of each plan version. Lock held, inside
        ``finish_run``'s transaction."""
        from fedrelay.v1 import coordinator_pb2

        head = self._db.execute("SELECT seq, hash FROM events WHERE run_id = ? ORDER BY seq DESC LIMIT 1",
                                (run_id,)).fetchone()
        count = self._db.execute("SELECT COUNT(*) FROM events WHERE run_id = ?", (run_id,)).fetchone()[0]
        row = dict(self._db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone())
        plans = [r["plan"] for r in self._db.execute("SELECT plan FROM plans WHERE run_id = ? ORDER BY version",
                                                     (run_id,))]
        seal = coordinator_pb2.RunSeal(
            run_id=run_id, events=count, last_seq=head["seq"] if head else 0,
            head=(head["hash"] if head else "") or hashchain.genesis(run_id), run_json=hashchain.sealed_run(row),
            plans=[hashchain.plan_digest(p) for p in plans], sealed=now)
        signed = self.sealer(seal)
        fp = self._keep_certificate(signed, now)
        self._db.execute("INSERT OR REPLACE INTO seals (run_id, seq, record, signature, certificate, signer) "
                         "VALUES (?, ?, ?, ?, ?, ?)", (run_id, seal.last_seq, signed.record, signed.signature, fp,
                                                       signed.signer))

    def last_event_seq(self) -> int:
        """The seq of the newest event of any run (0 when none)."""
        return int(self._store.exec("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])

    def events_after(self, run_id: str, seq: int) -> list[dict[str, Any]]:
        """The run's events with seq > ``seq``, oldest first: seq, run_id, time, kind, site, message,
        data (JSON text)."""
        return self._store.all("SELECT seq, run_id, time, kind, site, message, data FROM events "
                               "WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, seq))

    def wait_for_events(self, timeout: float) -> None:
        """Block until any event is added or ``timeout`` seconds pass."""
        with self.changed:
            self.changed.wait(timeout)
