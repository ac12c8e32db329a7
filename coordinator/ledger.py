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
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from fedrelay import signing
from fedrelay.coordinator import hashchain

SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    name TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    classes TEXT NOT NULL,          -- unused since tasks (kept for older ledgers): '[]'
    channels INTEGER, height INTEGER, width INTEGER,  -- unused since tasks
    tasks TEXT NOT NULL DEFAULT '[]',  -- JSON [fedrelay.tasks.offers.Offer.to_dict()]: what the site offers
    device TEXT, version TEXT,
    registered REAL, last_seen REAL,
    instance TEXT                   -- the daemon process's random id (RegisterRequest.instance)
);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created REAL NOT NULL, ended REAL,
    status TEXT NOT NULL,           -- running | finished | failed | cancelled
    strategy TEXT NOT NULL, arch TEXT NOT NULL, seed INTEGER NOT NULL,
    params TEXT NOT NULL,           -- JSON of TrainingParams
    chain TEXT NOT NULL,            -- JSON [{"name", "address"}] in chain order
    class_index TEXT NOT NULL,      -- JSON list
    model TEXT NOT NULL,            -- JSON of ModelSpec
    warnings TEXT NOT NULL,         -- JSON list
    model_bytes INTEGER,            -- M, the safetensors size
    final_sha256 TEXT, final_site TEXT,
    accuracy REAL,
    error TEXT,
    insecure INTEGER NOT NULL DEFAULT 1,
    rounds INTEGER NOT NULL DEFAULT 1,  -- T
    schema_sha256 TEXT,             -- the payload schema of the run's first done transfer
    upload_bytes INTEGER,           -- star plans: size of one upload payload (M + the aggregator's extras)
    upload_schema_sha256 TEXT,      -- star plans: the uploads' payload schema
    cancelled_by TEXT,              -- status cancelled: the operator's identity (or "insecure operator")
    cancel_reason TEXT,             -- status cancelled: the reason given
    task TEXT, task_version TEXT,   -- the run's task (model: its fedrelay.ModelSpec)
    task_sha256 TEXT,               -- the digest of the task's code every site ran
    metrics TEXT,                   -- JSON {name: value}: the global metrics (fedrelay.scoring)
    started_by TEXT,                -- the operator's identity that started the run (or "insecure operator")
    refused_by TEXT,                -- the site that refused its assignment (the run failed before any transfer)
    refusal TEXT,                   -- that site's reason
    refused_by_policy INTEGER NOT NULL DEFAULT 0  -- 1: the site's own policy refused it (peer/policy.py)
);
CREATE TABLE IF NOT EXISTS plans (
    run_id TEXT NOT NULL, version INTEGER NOT NULL,
    plan TEXT NOT NULL,             -- JSON of coordinator.plan.Plan
    time REAL NOT NULL,
    PRIMARY KEY (run_id, version)
);
CREATE TABLE IF NOT EXISTS receipts (
    run_id TEXT NOT NULL, purpose TEXT NOT NULL, hop INTEGER NOT NULL, receiver TEXT NOT NULL,
    sender TEXT NOT NULL, payload_bytes INTEGER NOT NULL, sha256 TEXT NOT NULL,
    schema_sha256 TEXT NOT NULL, received REAL NOT NULL,
    route TEXT NOT NULL DEFAULT 'direct',       -- direct | relayed (fetched from a relay, sealed)
    relay_wire_bytes INTEGER NOT NULL DEFAULT 0,  -- relayed: wire bytes of the relay -> receiver leg
    PRIMARY KEY (run_id, purpose, hop, receiver)
);
CREATE TABLE IF NOT EXISTS hops (
    run_id TEXT NOT NULL,
    purpose TEXT NOT NULL,          -- chain | upload | final
    hop INTEGER NOT NULL,
    sender TEXT NOT NULL, receiver TEXT NOT NULL,
    payload_bytes INTEGER NOT NULL, wire_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    started REAL NOT NULL, ended REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 1,      -- streams the transfer took
    resumed_from INTEGER NOT NULL DEFAULT 0,  -- bytes the receiver held when the last stream began
    round INTEGER NOT NULL DEFAULT 1,
    schema_sha256 TEXT NOT NULL DEFAULT '',
    route TEXT NOT NULL DEFAULT 'direct',     -- direct | relayed (then wire_bytes: the sender -> relay leg)
    sealed_bytes INTEGER NOT NULL DEFAULT 0,  -- relayed: size of the sealed envelope
    sealed_sha256 TEXT NOT NULL DEFAULT '',   -- relayed: SHA-256 of the sealed envelope
    relay TEXT NOT NULL DEFAULT '',           -- relayed: the relay's address
    PRIMARY KEY (run_id, purpose, hop, receiver)
);
CREATE TABLE IF NOT EXISTS evaluations (
    run_id TEXT NOT NULL, site TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    correct INTEGER NOT NULL, test_samples INTEGER NOT NULL, accuracy REAL NOT NULL,
    seconds REAL,
    metrics TEXT NOT NULL DEFAULT '{}',  -- JSON {name: value}: the site's exact metrics
    stats TEXT NOT NULL DEFAULT '{}',    -- JSON fedrelay.scoring.Stats: the site's aggregate statistics
    PRIMARY KEY (run_id, site)
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, site TEXT NOT NULL, time REAL NOT NULL,
    stage TEXT, model INTEGER, epoch INTEGER, epochs INTEGER,
    train_loss REAL, val_accuracy REAL, seconds REAL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, time REAL NOT NULL,
    kind TEXT NOT NULL, site TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}',
    prev_hash TEXT NOT NULL DEFAULT '',  -- the run's previous event's hash (its first: hashchain.genesis)
    hash TEXT NOT NULL DEFAULT '',       -- SHA-256 of prev_hash and this event (hashchain.event_hash)
    record TEXT NOT NULL DEFAULT ''      -- the binding digest of the signed record recorded with it, or ''
);
CREATE INDEX IF NOT EXISTS events_run ON events (run_id, seq);
CREATE TABLE IF NOT EXISTS records (  -- signed reports and evaluations, as their signers signed them
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,           -- the event that binds it into the run's hash chain
    type TEXT NOT NULL,             -- HopReport | ReceiptReport | FinalReport | FailureReport | EvaluateReply
    signer TEXT NOT NULL,           -- the identity that signed it (its certificate's name)
    record BLOB NOT NULL,           -- the canonical bytes signed (fedrelay/signing.py)
    signature BLOB NOT NULL,        -- empty: unsigned (a plaintext run)
    certificate TEXT NOT NULL,      -- fingerprint of the signer's certificate (certificates.sha256); '' unsigned
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS certificates (
    sha256 TEXT PRIMARY KEY,        -- SHA-256 of the certificate's DER bytes
    name TEXT NOT NULL,             -- its common name
    pem TEXT NOT NULL,
    first_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS seals (  -- the coordinator's signed RunSeal of each ended run
    run_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,           -- the last event it covers (the run's terminal event)
    record BLOB NOT NULL, signature BLOB NOT NULL, certificate TEXT NOT NULL,
    signer TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS hops_run ON hops (run_id, purpose);
CREATE TABLE IF NOT EXISTS skips (
    run_id TEXT NOT NULL, site TEXT NOT NULL,
    time REAL NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (run_id, site)
);
CREATE TABLE IF NOT EXISTS end_notices (  -- "the run is over", owed to every site of an ended run
    run_id TEXT NOT NULL, site TEXT NOT NULL,
    delivered REAL,                 -- unix seconds the site's EndRun answered; NULL: still owed
    PRIMARY KEY (run_id, site)
);
CREATE INDEX IF NOT EXISTS end_notices_owed ON end_notices (run_id) WHERE delivered IS NULL;
CREATE TABLE IF NOT EXISTS forgotten (  -- registrations the operator removed (coordinator forget-peer)
    name TEXT PRIMARY KEY,
    instance TEXT NOT NULL,         -- the daemon instance that was registered ("" if none)
    time REAL NOT NULL              -- unix seconds it was forgotten
);
"""

TERMINAL = ("finished", "failed", "cancelled")
SENDER_SIDE = ("sender", "payload_bytes", "sha256", "schema_sha256")
LAST_SEEN_FLUSH = 30.0  # seconds a heartbeat's last_seen may stay in memory only (Ledger.upsert_peer)


class LedgerConflict(ValueError):
    """A report contradicts what the ledger already holds for the same transfer."""


# A transfer only its receiver has reported: the sender's relay columns.
_UNSENT = {"route": "", "sealed_bytes": 0, "sealed_sha256": "", "relay": ""}


def transfer_status(sent: dict | None, received: dict | None) -> str:
    """``done`` when the sender's report and the receiver's attestation agree on sender, bytes,
    SHA-256 and schema; ``sent`` / ``received`` while only one end has spoken; ``disputed`` when
    they disagree."""
    if sent is None:
        return "received"
    if received is None:
        return "sent"
    same = all(sent[k] == received[k] for k in ("sender", "payload_bytes", "sha256")) and (
        not sent["schema_sha256"] or sent["schema_sha256"] == received["schema_sha256"])
    return "done" if same else "disputed"


class LedgerError(RuntimeError):
    """The ledger file cannot be opened or written; the message names the path and the fix."""


def _open_error(path: Path, exc: Exception) -> LedgerError:
    """A ``LedgerError`` for a ledger at ``path`` that failed to open with ``exc``."""
    text = str(exc)
    if "not a database" in text:
        why = "it is not an SQLite database (some other file?); pass another --db path"
    elif "readonly" in text or "read-only" in text or isinstance(exc, PermissionError) or (
            path.parent.is_dir() and not os.access(path.parent, os.W_OK)):
        why = (f"the folder {path.parent} or the file is not writable (the ledger writes the file and its "
               "-wal/-shm journal next to it); pass --db in a folder this user can write")
    else:
        why = "pass --db FILE in a folder this user can write"
    return LedgerError(f"cannot open the ledger {path}: {text}; {why}")


class Ledger:
    """Thread-safe access to the SQLite ledger at ``path`` (``":memory:"`` for tests).

    Raises ``LedgerError`` when ``path`` is a folder, not an SQLite database, or not writable
    (with its folder), before anything is served."""

    def __init__(self, path: str | Path):
        if str(path) != ":memory:":
            p = Path(path)
            if p.is_dir():
                raise LedgerError(f"--db {p} is a folder; pass the ledger's file, e.g. {p / 'ledger.sqlite'}")
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LedgerError(f"cannot create the ledger's folder {p.parent}: {exc.strerror or exc}; "
                                  "pass --db in a folder this user can write") from None
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._lock = threading.RLock()
            self._events = threading.Condition(self._lock)
            self.on_run_ended: list = []  # callables (run_id, status, error), after a run ended (finish_run)
            self.on_event: list = []  # callables (event row), under the lock, once the event is committed
            # Signs a run's RunSeal when it ends (the coordinator's key); unsigned by default.
            self.sealer: Callable[[Any], signing.SignedRecord] = lambda seal: signing.unsigned("coordinator", seal)
            # Heartbeats: a registration that changes nothing but last_seen is kept in memory
            # (``_seen``) and written for all sites at once every ``last_seen_flush`` seconds.
            self.last_seen_flush = LAST_SEEN_FLUSH
            self._peer_rows: dict[str, tuple] = {}  # name -> what the ledger holds besides last_seen
            self._instances: dict[str, str] = {}  # name -> the daemon instance id the ledger holds
            self._seen: dict[str, float] = {}  # name -> last_seen newer than the ledger's
            self._peer_memo: dict[str, dict] = {}  # name -> its row as ``peer`` read it (dropped on a write)
            self._flushed = time.monotonic()
            self._plans: dict[str, list[dict]] = {}  # run id -> every version of its plan (immutable)
            self._forgotten_memo: dict[str, dict] | None = None  # the forgotten table (None: not read yet)
            self._in_batch = False
            self._deferred: list[dict] = []  # events of the open batch, published at its commit
            self._heads: dict[str, str] = {}  # run id -> the hash of its latest event (read once per run)
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(SCHEMA)
                self._migrate()
        except (sqlite3.Error, OSError) as exc:
            if hasattr(self, "_db"):
                self._db.close()
            raise _open_error(Path(path), exc) from None

    def _migrate(self) -> None:
        """Bring a ledger written by an older fedrelay up to this schema (columns added since)."""
        added = {"hops": ("attempts INTEGER NOT NULL DEFAULT 1", "resumed_from INTEGER NOT NULL DEFAULT 0",
                          "round INTEGER NOT NULL DEFAULT 1", "schema_sha256 TEXT NOT NULL DEFAULT ''",
                          "route TEXT NOT NULL DEFAULT 'direct'", "sealed_bytes INTEGER NOT NULL DEFAULT 0",
                          "sealed_sha256 TEXT NOT NULL DEFAULT ''", "relay TEXT NOT NULL DEFAULT ''"),
                 "receipts": ("route TEXT NOT NULL DEFAULT 'direct'", "relay_wire_bytes INTEGER NOT NULL DEFAULT 0"),
                 "runs": ("rounds INTEGER NOT NULL DEFAULT 1", "schema_sha256 TEXT", "upload_bytes INTEGER",
                          "upload_schema_sha256 TEXT", "cancelled_by TEXT", "cancel_reason TEXT", "task TEXT",
                          "task_version TEXT", "task_sha256 TEXT", "metrics TEXT", "started_by TEXT", "refused_by TEXT",
                          "refusal TEXT", "refused_by_policy INTEGER NOT NULL DEFAULT 0"),
                 "evaluations": ("metrics TEXT NOT NULL DEFAULT '{}'", "stats TEXT NOT NULL DEFAULT '{}'"),
                 "peers": ("instance TEXT", "tasks TEXT NOT NULL DEFAULT '[]'"),
                 "events": ("prev_hash TEXT NOT NULL DEFAULT ''", "hash TEXT NOT NULL DEFAULT ''",
                            "record TEXT NOT NULL DEFAULT ''")}
        for table, columns in added.items():
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for column in columns:
                if column.split()[0] not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def close(self) -> None:
        with self._lock:
            self.flush_last_seen()
            self._db.close()

    @property
    def lock(self) -> threading.RLock:
        """The ledger's (re-entrant) lock: held, nothing is written or published meanwhile."""
        return self._lock

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
                self._publish(event)

    def _publish(self, event: dict) -> None:
        """Hand a committed event to the listeners and wake ``wait_for_events`` (lock held)."""
        for listener in self.on_event:
            listener(event)
        self._events.notify_all()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def _all(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    # -- peers ---------------------------------------------------------------------------------
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
        self._exec(
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
                rows = self._all("SELECT name, address, last_seen, instance FROM peers WHERE name = ?", (name,))
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
            self._exec("UPDATE peers SET instance = ? WHERE name = ?", (instance, name))
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
            with self.batch():
                gone = self._exec("DELETE FROM peers WHERE name = ?", (name,)).rowcount == 1
                self._exec("INSERT OR REPLACE INTO forgotten (name, instance, time) VALUES (?, ?, ?)",
                           (name, peer["instance"] or "", time.time()))
            self._forgotten_memo = None
            return gone

    def forgotten(self, name: str) -> dict[str, Any] | None:
        """``name``'s removal by the operator (name, instance, time: unix seconds), or None when
        it was not removed (or registered anew since). Read from memory after the first call."""
        with self._lock:
            if self._forgotten_memo is None:
                self._forgotten_memo = {r["name"]: r for r in self._all("SELECT * FROM forgotten")}
            row = self._forgotten_memo.get(name)
            return dict(row) if row is not None else None

    def unforget(self, name: str) -> None:
        """Drop ``name``'s removal record (a new daemon registers it anew)."""
        with self._lock:
            self._exec("DELETE FROM forgotten WHERE name = ?", (name,))
            self._forgotten_memo = None

    def peers(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = [self._overlay(r) for r in self._all("SELECT * FROM peers ORDER BY name")]
        for r in rows:
            r["tasks"] = json.loads(r["tasks"] or "[]")
            for k in ("classes", "channels", "height", "width"):
                r.pop(k, None)
        return rows

    def last_seen(self) -> dict[str, float]:
        """Every registered site's latest registration or heartbeat (unix seconds)."""
        with self._lock:
            return {r["name"]: self._overlay(r)["last_seen"] or 0.0
                    for r in self._all("SELECT name, last_seen FROM peers")}

    # -- runs ----------------------------------------------------------------------------------
    def create_run(self, run_id: str, *, strategy: str, arch: str, seed: int, params: dict,
                   chain: list[dict], class_index: list[str], model: dict, warnings: list[str],
                   insecure: bool, rounds: int = 1, plan: dict | None = None, started_by: str = "") -> None:
        """Record a new running run and, when given, version 0 of its plan (one transaction).
        ``model``: the run's ``fedrelay.ModelSpec.to_dict()`` (its task, version and digest are
        also kept in columns of their own); ``arch``: the task's model name; ``started_by``: the
        operator identity that started it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                self._db.execute(
                    """INSERT INTO runs (run_id, created, status, strategy, arch, seed, params, chain,
                                         class_index, model, warnings, insecure, rounds, task, task_version,
                                         task_sha256, started_by)
                       VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (run_id, now, strategy, arch, seed, json.dumps(params), json.dumps(chain),
                     json.dumps(class_index), json.dumps(model), json.dumps(warnings), int(insecure), rounds,
                     model.get("task", ""), model.get("task_version", ""), model.get("task_sha256", ""),
                     started_by),
                )
                if plan is not None:
                    self._db.execute("INSERT INTO plans (run_id, version, plan, time) VALUES (?, 0, ?, ?)",
                                     (run_id, json.dumps(plan), now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- plans ---------------------------------------------------------------------------------
    def plans(self, run_id: str) -> list[dict]:
        """Every version of the run's plan, oldest first: ``[{"version", "plan", "time"}]``.
        Versions never change once written: they are read from the file once per run and kept
        (callers must not modify them)."""
        with self._lock:
            cached = self._plans.get(run_id)
            if cached:
                return list(cached)
            rows = self._all("SELECT version, plan, time FROM plans WHERE run_id = ? ORDER BY version", (run_id,))
            for r in rows:
                r["plan"] = json.loads(r["plan"])
            if rows:
                self._plans[run_id] = rows
            return list(rows)

    def reroute(self, run_id: str, plan: dict, skips: list[tuple[str, str]]) -> int | None:
        """Record, in one transaction, the sites newly routed around (``[(site, reason)]``) and
        the plan that goes around them, as the next version. Returns that version, or None when
        every site given was already skipped (nothing written)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                new = 0
                for site, reason in skips:
                    new += self._db.execute(
                        "INSERT OR IGNORE INTO skips (run_id, site, time, reason) VALUES (?, ?, ?, ?)",
                        (run_id, site, now, reason)).rowcount
                if not new:
                    self._db.execute("ROLLBACK")
                    return None
                version = self._db.execute("SELECT COALESCE(MAX(version), -1) + 1 FROM plans WHERE run_id = ?",
                                           (run_id,)).fetchone()[0]
                self._db.execute("INSERT INTO plans (run_id, version, plan, time) VALUES (?, ?, ?, ?)",
                                 (run_id, version, json.dumps(plan), now))
                self._db.execute("COMMIT")
                self._plans.pop(run_id, None)  # read again, with the new version, on the next question
                return version
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def run(self, run_id: str) -> dict[str, Any] | None:
        rows = self._all("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            return None
        r = rows[0]
        for key in ("params", "chain", "class_index", "model", "warnings"):
            r[key] = json.loads(r[key])
        r["metrics"] = json.loads(r["metrics"]) if r.get("metrics") else {}
        return r

    def running_run_ids(self) -> list[str]:
        return [r["run_id"] for r in self._all("SELECT run_id FROM runs WHERE status = 'running' ORDER BY created")]

    def run_ids(self) -> list[str]:
        return [r["run_id"] for r in self._all("SELECT run_id FROM runs ORDER BY created")]

    def run_counts(self) -> dict[str, int]:
        """Runs by status: ``{status: count}`` (statuses with no run are absent)."""
        return {r["status"]: r["n"] for r in self._all("SELECT status, COUNT(*) AS n FROM runs GROUP BY status")}

    def update_run(self, run_id: str, **fields: Any) -> None:
        if not fields:
            return
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._exec(f"UPDATE runs SET {cols} WHERE run_id = ?", (*fields.values(), run_id))

    def finish_run(self, run_id: str, status: str, *, error: str | None = None,
                   accuracy: float | None = None, message: str = "", site: str = "",
                   cancelled_by: str | None = None, cancel_reason: str | None = None,
                   metrics: dict[str, float] | None = None, record: signing.SignedRecord | None = None,
                   **data: Any) -> bool:
        """Move a running run to ``status`` (finished|failed|cancelled) and, when ``message`` is given, add
        the event of kind ``status`` that says so, in one transaction: a watcher that sees the
        terminal status has also seen that event (its data holds ``error`` and ``accuracy`` when
        given, and ``data``). The same transaction owes every site of the chain an end notice
        (:meth:`pending_end_notices`) and sets ``cancelled_by`` / ``cancel_reason`` / the global
        ``metrics`` when given. ``record``: the signed report that ended it (a site's
        ``FailureReport``), bound to the event. The same transaction writes the run's seal
        (:meth:`_seal`). False (nothing written) when it had already ended."""
        data = {**({"error": error} if error is not None else {}),
                **({"accuracy": accuracy} if accuracy is not None else {}),
                **({"cancelled_by": cancelled_by} if cancelled_by is not None else {}),
                **({"metrics": metrics} if metrics is not None else {}), **data}
        with self._events:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                cur = self._db.execute(
                    "UPDATE runs SET status = ?, error = ?, accuracy = ?, ended = ?, "
                    "cancelled_by = coalesce(?, cancelled_by), cancel_reason = coalesce(?, cancel_reason), "
                    "metrics = coalesce(?, metrics) WHERE run_id = ? AND status = 'running'",
                    (status, error, accuracy, now, cancelled_by, cancel_reason,
                     json.dumps(metrics, sort_keys=True) if metrics is not None else None, run_id),
                )
                ended = cur.rowcount == 1
                if ended:
                    chain = json.loads(self._db.execute("SELECT chain FROM runs WHERE run_id = ?",
                                                        (run_id,)).fetchone()["chain"])
                    self._db.executemany("INSERT OR IGNORE INTO end_notices (run_id, site) VALUES (?, ?)",
                                         [(run_id, c["name"]) for c in chain])
                event = None
                if ended and message:
                    event = {"run_id": run_id, "time": now, "kind": status, "site": site, "message": message,
                             "data": json.dumps(data)}
                    event["seq"] = self._append_event(event, record)
                if ended:
                    self._seal(run_id, now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._heads.pop(run_id, None)
                raise
            if event is not None:
                self._publish(event)
            for listener in self.on_run_ended if ended else ():
                listener(run_id, status, error)
            return ended

    def cancel_run(self, run_id: str, cancelled_by: str, reason: str) -> bool:
        """End a running run with status ``cancelled``, recording who (``cancelled_by``) and why
        (``reason``; the time is ``ended``), the ``cancelled`` event and the end notices owed to
        its sites (:meth:`finish_run`), in one transaction. False (nothing written) when it had
        already ended."""
        why = f": {reason}" if reason else ""
        return self.finish_run(run_id, "cancelled", message=f"run cancelled by {cancelled_by}{why}",
                               cancelled_by=cancelled_by, cancel_reason=reason, reason=reason)

    def refuse_run(self, run_id: str, site: str, reason: str, *, policy: bool) -> bool:
        """End a running run as failed because ``site`` refused its assignment for ``reason``
        (``policy``: its own site policy refused it): the run's ``refused_by``, ``refusal`` and
        ``refused_by_policy`` say so, and the ``failed`` event (site = ``site``) carries them.
        False (nothing written) when it had already ended."""
        if self.run(run_id) is None or self.run(run_id)["status"] != "running":
            return False
        self.update_run(run_id, refused_by=site, refusal=reason, refused_by_policy=int(policy))
        error = f"assignment refused by {site}: {'its site policy: ' if policy else ''}{reason}"
        return self.finish_run(run_id, "failed", error=error, message=f"run failed: {error}", site=site,
                               refused_by=site, refusal=reason, refused_by_policy=policy)

    # -- hops ----------------------------------------------------------------------------------
    def record_hop(self, run_id: str, purpose: str, hop: int, sender: str, receiver: str,
                   payload_bytes: int, wire_bytes: int, sha256: str, started: float,
                   ended: float, attempts: int = 1, resumed_from: int = 0, round: int = 1,
                   schema_sha256: str = "", route: str = "direct", sealed_bytes: int = 0,
                   sealed_sha256: str = "", relay: str = "") -> bool:
        """Record the sender's report of one transfer (sizes in bytes, times in unix seconds;
        ``wire_bytes`` counts every attempt, ``resumed_from`` the bytes the receiver held when the
        last one began). ``route`` "relayed": the payload went to the relay at ``relay`` as a
        sealed envelope of ``sealed_bytes`` bytes (SHA-256 ``sealed_sha256``), and ``wire_bytes``
        are the sender -> relay leg's. Returns False when the same report was already recorded (a
        retry). Raises ``LedgerConflict`` when a different one was: nothing is overwritten."""
        with self._lock:
            cur = self._db.execute(
                """INSERT OR IGNORE INTO hops (run_id, purpose, hop, sender, receiver, payload_bytes,
                                              wire_bytes, sha256, started, ended, attempts, resumed_from,
                                              round, schema_sha256, route, sealed_bytes, sealed_sha256, relay)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (run_id, purpose, hop, sender, receiver, payload_bytes, wire_bytes, sha256, started, ended,
                 max(1, attempts), resumed_from, round, schema_sha256, route or "direct", sealed_bytes,
                 sealed_sha256, relay),
            )
            if cur.rowcount == 1:
                return True
            have = self._db.execute("SELECT sender, payload_bytes, sha256 FROM hops WHERE run_id = ? AND "
                                    "purpose = ? AND hop = ? AND receiver = ?", (run_id, purpose, hop, receiver)).fetchone()
            if tuple(have) != (sender, payload_bytes, sha256):
                raise LedgerConflict(f"{purpose} transfer {hop} to {receiver} was already reported as "
                                     f"{have['sender']} -> {receiver}, {have['payload_bytes']} bytes, sha256 {have['sha256'][:12]}")
            return False

    def record_receipt(self, run_id: str, purpose: str, hop: int, sender: str, receiver: str,
                       payload_bytes: int, sha256: str, schema_sha256: str, received: float,
                       route: str = "direct", relay_wire_bytes: int = 0) -> bool:
        """Record the receiver's attestation of one transfer (what it verified and kept; ``route``
        "relayed": fetched from a relay, ``relay_wire_bytes`` on that leg). Returns False for a
        repeat of the same attestation; raises ``LedgerConflict`` for a different one."""
        with self._lock:
            cur = self._db.execute(
                """INSERT OR IGNORE INTO receipts (run_id, purpose, hop, receiver, sender, payload_bytes, sha256,
                                                   schema_sha256, received, route, relay_wire_bytes)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (run_id, purpose, hop, receiver, sender, payload_bytes, sha256, schema_sha256, received,
                 route or "direct", relay_wire_bytes))
            if cur.rowcount == 1:
                return True
            have = self._db.execute("SELECT sender, payload_bytes, sha256, schema_sha256 FROM receipts WHERE "
                                    "run_id = ? AND purpose = ? AND hop = ? AND receiver = ?",
                                    (run_id, purpose, hop, receiver)).fetchone()
            if tuple(have) != (sender, payload_bytes, sha256, schema_sha256):
                raise LedgerConflict(f"{purpose} transfer {hop} to {receiver} was already attested as "
                                     f"from {have['sender']}, {have['payload_bytes']} bytes, sha256 {have['sha256'][:12]}")
            return False

    def hops(self, run_id: str, purpose: str = "chain") -> list[dict[str, Any]]:
        """The transfers of ``purpose`` that either end has reported, by (hop, receiver): the
        sender's columns (None where only the receiver has spoken), ``receipt`` (the receiver's
        attestation as a dict, or None) and ``status`` (:func:`transfer_status`)."""
        sent = {(r["hop"], r["receiver"]): r for r in self._all(
            "SELECT * FROM hops WHERE run_id = ? AND purpose = ?", (run_id, purpose))}
        got = {(r["hop"], r["receiver"]): r for r in self._all(
            "SELECT * FROM receipts WHERE run_id = ? AND purpose = ?", (run_id, purpose))}
        out = []
        for key in sorted(set(sent) | set(got)):
            row = dict(sent.get(key) or {"run_id": run_id, "purpose": purpose, "hop": key[0], "receiver": key[1],
                                         "sender": got[key]["sender"], "payload_bytes": None, "wire_bytes": None,
                                         "sha256": None, "started": None, "ended": None, "attempts": 0,
                                         "resumed_from": 0, "round": None, "schema_sha256": "", **_UNSENT})
            row["receipt"] = got.get(key)
            row["status"] = transfer_status(sent.get(key), got.get(key))
            out.append(row)
        return out

    def transfer(self, run_id: str, purpose: str, hop: int, receiver: str) -> dict[str, Any] | None:
        """One transfer's row as in :meth:`hops` (None when neither end has reported it): two
        primary-key lookups, whatever the run's size."""
        key = (run_id, purpose, hop, receiver)
        where = "WHERE run_id = ? AND purpose = ? AND hop = ? AND receiver = ?"
        with self._lock:
            sent = self._all(f"SELECT * FROM hops {where}", key)
            got = self._all(f"SELECT * FROM receipts {where}", key)
        if not sent and not got:
            return None
        row = dict(sent[0] if sent else {"run_id": run_id, "purpose": purpose, "hop": hop, "receiver": receiver,
                                         "sender": got[0]["sender"], "payload_bytes": None, "wire_bytes": None,
                                         "sha256": None, "started": None, "ended": None, "attempts": 0,
                                         "resumed_from": 0, "round": None, "schema_sha256": "", **_UNSENT})
        row["receipt"] = got[0] if got else None
        row["status"] = transfer_status(sent[0] if sent else None, row["receipt"])
        return row

    def transfer_totals(self) -> dict[str, dict[str, int]]:
        """Every run's transfers as their senders reported them, by purpose (chain|upload|final):
        ``{purpose: {"transfers", "payload_bytes", "wire_bytes", "retries" (streams beyond the
        first), "resumed_bytes" (bytes the receivers already held when the last stream began)}}``."""
        rows = self._all("""SELECT purpose, COUNT(*) AS transfers, SUM(payload_bytes) AS payload_bytes,
                                   SUM(wire_bytes) AS wire_bytes, SUM(MAX(attempts, 1) - 1) AS retries,
                                   SUM(resumed_from) AS resumed_bytes FROM hops GROUP BY purpose""")
        return {r.pop("purpose"): r for r in rows}

    # -- routing around sites that stayed down -----------------------------------------------------
    def add_skip(self, run_id: str, site: str, reason: str) -> bool:
        """Record that ``site`` was routed around in ``run_id``. False if it already was."""
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO skips (run_id, site, time, reason) VALUES (?, ?, ?, ?)",
                                   (run_id, site, time.time(), reason))
            return cur.rowcount == 1

    def pending_end_notices(self) -> list[dict[str, Any]]:
        """End notices not yet delivered: ``[{"run_id", "site", "status", "error", "cancelled_by",
        "cancel_reason"}]``, oldest run first."""
        return self._all("""SELECT n.run_id, n.site, r.status, r.error, r.cancelled_by, r.cancel_reason
                            FROM end_notices n
                            JOIN runs r ON r.run_id = n.run_id
                            WHERE n.delivered IS NULL ORDER BY r.ended, n.site""")

    def end_notice_delivered(self, run_id: str, site: str) -> None:
        self._exec("UPDATE end_notices SET delivered = ? WHERE run_id = ? AND site = ?", (time.time(), run_id, site))

    def skips(self, run_id: str) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM skips WHERE run_id = ? ORDER BY time", (run_id,))

    # -- evaluations and metrics -----------------------------------------------------------------
    def record_evaluation(self, run_id: str, site: str, sha256: str, correct: int, test_samples: int,
                          accuracy: float, seconds: float, metrics: dict[str, float] | None = None,
                          stats: dict | None = None) -> None:
        """A site's evaluation of the final model: its top-1 count, exact ``metrics`` and aggregate
        ``stats`` (``fedrelay.scoring``)."""
        self._exec(
            """INSERT OR REPLACE INTO evaluations (run_id, site, sha256, correct, test_samples, accuracy, seconds,
                                                   metrics, stats)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (run_id, site, sha256, correct, test_samples, accuracy, seconds, json.dumps(metrics or {}, sort_keys=True),
             json.dumps(stats or {}, sort_keys=True)),
        )

    def evaluations(self, run_id: str) -> list[dict[str, Any]]:
        """The sites' evaluations, ``metrics`` and ``stats`` parsed."""
        rows = self._all("SELECT * FROM evaluations WHERE run_id = ? ORDER BY site", (run_id,))
        for r in rows:
            r["metrics"] = json.loads(r.get("metrics") or "{}")
            r["stats"] = json.loads(r.get("stats") or "{}")
        return rows

    def recent_results(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` most recently ended finished runs: ``run_id``, ``task``, ``accuracy``,
        ``metrics`` (global, parsed) and ``evaluations`` (per site, as :meth:`evaluations`)."""
        rows = self._all("SELECT run_id, task, accuracy, metrics FROM runs WHERE status = 'finished' "
                         "ORDER BY ended DESC LIMIT ?", (int(limit),))
        for r in rows:
            r["metrics"] = json.loads(r["metrics"]) if r["metrics"] else {}
            r["evaluations"] = self.evaluations(r["run_id"])
        return rows

    def record_metric(self, run_id: str, site: str, stage: str, model: int, epoch: int, epochs: int,
                      train_loss: float, val_accuracy: float | None, seconds: float) -> None:
        self._exec(
            """INSERT INTO metrics (run_id, site, time, stage, model, epoch, epochs, train_loss,
                                    val_accuracy, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (run_id, site, time.time(), stage, model, epoch, epochs, train_loss, val_accuracy, seconds),
        )

    def metrics(self, run_id: str) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM metrics WHERE run_id = ? ORDER BY time", (run_id,))

    # -- events --------------------------------------------------------------------------------
    def add_event(self, run_id: str, kind: str, message: str, site: str = "", *,
                  record: signing.SignedRecord | None = None, **data: Any) -> int:
        """Append an event to the run's log (and hash chain); returns its seq. ``record``: the
        signed report or evaluation this event records, kept in ``records`` and bound into the
        chain by this event. Listeners (``on_event``) get it once committed (at the end of a
        ``batch``)."""
        event = {"run_id": run_id, "time": time.time(), "kind": kind, "site": site, "message": message,
                 "data": json.dumps(data)}
        with self._events:
            own = record is not None and not self._in_batch  # several rows: one transaction
            if own:
                self._db.execute("BEGIN IMMEDIATE")
            try:
                event["seq"] = self._append_event(event, record)
                if own:
                    self._db.execute("COMMIT")
            except BaseException:
                if own:
                    self._db.execute("ROLLBACK")
                    self._heads.pop(run_id, None)
                raise
            if self._in_batch:
                self._deferred.append(event)
            else:
                self._publish(event)
            return event["seq"]

    def _append_event(self, event: dict[str, Any], record: signing.SignedRecord | None) -> int:
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

    def _seal(self, run_id: str, now: float) -> None:
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
        return int(self._exec("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])

    def events_after(self, run_id: str, seq: int) -> list[dict[str, Any]]:
        """The run's events with seq > ``seq``, oldest first: seq, run_id, time, kind, site, message,
        data (JSON text)."""
        return self._all("SELECT seq, run_id, time, kind, site, message, data FROM events "
                         "WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, seq))

    def wait_for_events(self, timeout: float) -> None:
        """Block until any event is added or ``timeout`` seconds pass."""
        with self._events:
            self._events.wait(timeout)
