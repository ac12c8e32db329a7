"""The ledger's file: its SQLite schema, the migration of older ledgers, and opening it.

:data:`SCHEMA` is every table of the ledger (what each holds: ``coordinator/ledger.py``);
:func:`migrate` adds the columns that were added since an older fedrelay wrote the file;
:class:`Store` opens the file (WAL, synchronous writes) and is the one connection and lock that
``Ledger`` and its parts (``ledger_peers.py``, ``ledger_runs.py``, ``ledger_transfers.py``,
``ledger_results.py``, ``ledger_events.py``) share. :class:`LedgerError` says why a file cannot
be opened, naming the path and the fix.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

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


def migrate(db: sqlite3.Connection) -> None:
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
        have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
        for column in columns:
            if column.split()[0] not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


class LedgerError(RuntimeError):
    """The ledger file cannot be opened or written; the message names the path and the fix."""


def open_error(path: Path, exc: Exception) -> LedgerError:
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


class Store:
    """The SQLite connection to the ledger at ``path`` (``":memory:"`` for tests) and the
    re-entrant ``lock`` that serialises its use; the schema is created (and an older ledger
    migrated) on opening.

    Raises ``LedgerError`` when ``path`` is a folder, not an SQLite database, or not writable
    (with its folder)."""

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
            self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.lock = threading.RLock()
            with self.lock:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")
                self.db.executescript(SCHEMA)
                migrate(self.db)
        except (sqlite3.Error, OSError) as exc:
            if hasattr(self, "db"):
                self.db.close()
            raise open_error(Path(path), exc) from None

    def exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        """Run one statement under the lock; returns its cursor."""
        with self.lock:
            return self.db.execute(sql, args)

    def all(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        """Every row of one query, as dicts (column -> value), read under the lock."""
        with self.lock:
            return [dict(r) for r in self.db.execute(sql, args).fetchall()]

    def close(self) -> None:
        with self.lock:
            self.db.close()
