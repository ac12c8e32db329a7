"""The sites' registrations in the ledger (``peers``) and the ones the operator removed
(``forgotten``).

:class:`PeerRegistry` records registrations and heartbeats; a heartbeat that changes nothing but
``last_seen`` is kept in memory and written for every site at once (``last_seen_flush``
seconds apart), so a federation's heartbeats cost one write per interval, not one per site.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from fedrelay.coordinator.ledger_store import Store

LAST_SEEN_FLUSH = 30.0  # seconds a heartbeat's last_seen may stay in memory only (Ledger.upsert_peer)


class PeerRegistry:
    """The ``peers`` and ``forgotten`` tables of the ledger in ``store``; ``batch``: the ledger's
    transaction context (``EventLog.batch``)."""

    def __init__(self, store: Store, batch: Callable):
        self._store = store
        self._db = store.db
        self._lock = store.lock
        self._batch = batch
        # Heartbeats: a registration that changes nothing but last_seen is kept in memory
        # (``_seen``) and written for all sites at once every ``last_seen_flush`` seconds.
        self.last_seen_flush = LAST_SEEN_FLUSH
        self._peer_rows: dict[str, tuple] = {}  # name -> what the ledger holds besides last_seen
        self._instances: dict[str, str] = {}  # name -> the daemon instance id the ledger holds
        self._seen: dict[str, float] = {}  # name -> last_seen newer than the ledger's
        self._peer_memo: dict[str, dict] = {}  # name -> its row as ``peer`` read it (dropped on a write)
        self._flushed = time.monotonic()
        self._forgotten_memo: dict[str, dict] | None = None  # the forgotten table (None: not read yet)

    def upsert_peer(self, name: str, address: str, tasks: list[dict], device: str, version: str) -> bool:
        """Record a registration (or a heartbeat: the same registration again) at the current
        time. A heartbeat that changes nothing but ``last_seen`` writes nothing: its time is kept
        in memory (``peer`` and ``peers`` show it) and written, for every site at once, when
        ``last_seen_flush`` seconds have passed since the last such write, and at ``close``.
        ``tasks``: the site's offers (``Offer.to_dict()``). Returns True when the registration was
        written."""
        now = time.time()
        row = (address, json.dumps(tasks, sort_keys=True), device, version)
        with self._lock:
            if self._peer_rows.get(name) == row:
                self._seen[name] = now
                if time.monotonic() - self._flushed >= self.last_seen_flush:
                    self.flush_last_seen()
                return False
            self._write_peer(name, row, now)
            return True

    def flush_last_seen(self) -> int:
        """Write the heartbeats' times kept in memory, in one transaction; returns how many."""
        with self._lock:
            self._flushed = time.monotonic()
            if not self._seen:
                return 0
            seen, self._seen = self._seen, {}
            for n, t in seen.items():  # what is written is what peer() goes on showing
                if n in self._peer_memo:
                    self._peer_memo[n]["last_seen"] = max(self._peer_memo[n]["last_seen"] or 0.0, t)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("UPDATE peers SET last_seen = MAX(COALESCE(last_seen, 0), ?) WHERE name = ?",
                                     [(t, n) for n, t in seen.items()])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return len(seen)

    def _write_peer(self, name: str, row: tuple, now: float) -> None:
        self._seen.pop(name, None)
        self._peer_rows.pop(name, None)
        self._peer_memo.pop(name, None)
        self._store.exec(
            """INSERT INTO peers (name, address, classes, tasks, device, version, registered, last_seen)
               VALUES (?, ?, '[]', ?, ?, ?, ?, ?)
               ON CONFLICT(name) DO UPDATE SET address=excluded.address, tasks=excluded.tasks,
                   device=excluded.device, version=excluded.version, last_seen=excluded.last_seen""",
            (name, *row, now, now),
        )
        self._peer_rows[name] = row

    def _overlay(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with the latest heartbeat's time kept in memory, when newer (lock held)."""
        seen = self._seen.get(row["name"])
        if seen is not None and seen > (row["last_seen"] or 0):
            row["last_seen"] = seen
        return row

    def peer(self, name: str) -> dict[str, Any] | None:
        """``name``'s registration (name, address, last_seen, instance), or None. Read from SQLite
        once, then from memory until it changes (a heartbeat asks for it every time)."""
        with self._lock:
            if name not in self._peer_memo:
                rows = self._store.all("SELECT name, address, last_seen, instance FROM peers WHERE name = ?", (name,))
                if not rows:
                    return None
                self._peer_memo[name] = rows[0]
            return self._overlay(dict(self._peer_memo[name]))

    def registered_count(self) -> int:
        """How many sites registered (or heartbeat) since this ledger was opened."""
        return len(self._peer_rows)

    def set_peer_instance(self, name: str, instance: str) -> None:
        """Record the random id of the daemon process now serving ``name`` (after ``upsert_peer``);
        nothing is written when it is the one recorded."""
        with self._lock:
            if self._instances.get(name) == instance:
                return
            self._store.exec("UPDATE peers SET instance = ? WHERE name = ?", (instance, name))
            self._instances[name] = instance
            self._peer_memo.pop(name, None)

    def forget_peer(self, name: str) -> bool:
        """Remove ``name``'s registration, and remember that it was removed and the daemon
        instance it had (``forgotten``). False when no such peer is registered."""
        with self._lock:
            peer = self.peer(name)
            self._peer_rows.pop(name, None)
            self._instances.pop(name, None)
            self._seen.pop(name, None)
            self._peer_memo.pop(name, None)
            if peer is None:
                return False
            with self._batch():
                gone = self._store.exec("DELETE FROM peers WHERE name = ?", (name,)).rowcount == 1
                self._store.exec("INSERT OR REPLACE INTO forgotten (name, instance, time) VALUES (?, ?, ?)",
                                 (name, peer["instance"] or "", time.time()))
            self._forgotten_memo = None
            return gone

    def forgotten(self, name: str) -> dict[str, Any] | None:
        """``name``'s removal by the operator (name, instance, time: unix seconds), or None when
        it was not removed (or registered anew since). Read from memory after the first call."""
        with self._lock:
            if self._forgotten_memo is None:
                self._forgotten_memo = {r["name"]: r for r in self._store.all("SELECT * FROM forgotten")}
            row = self._forgotten_memo.get(name)
            return dict(row) if row is not None else None

    def unforget(self, name: str) -> None:
        """Drop ``name``'s removal record (a new daemon registers it anew)."""
        with self._lock:
            self._store.exec("DELETE FROM forgotten WHERE name = ?", (name,))
            self._forgotten_memo = None

    def peers(self) -> list[dict[str, Any]]:
        """Every registration, by name: the row with ``tasks`` parsed (the site's offers) and the
        latest heartbeat's ``last_seen``."""
        with self._lock:
            rows = [self._overlay(r) for r in self._store.all("SELECT * FROM peers ORDER BY name")]
        for r in rows:
            r["tasks"] = json.loads(r["tasks"] or "[]")
            for k in ("classes", "channels", "height", "width"):
                r.pop(k, None)
        return rows

    def last_seen(self) -> dict[str, float]:
        """Every registered site's latest registration or heartbeat (unix seconds)."""
        with self._lock:
            return {r["name"]: self._overlay(r)["last_seen"] or 0.0
                    for r in self._store.all("SELECT name, last_seen FROM peers")}
