"""Audit bundles: one run's records read from a ledger, written to and read from one JSON file,
and the CA certificates an audit checks them against.

A bundle (:func:`bundle_from_ledger`) holds the run's row, every version of its plan, its events
with their hash chain, the signed records, the certificates that signed them, the coordinator's
seal, and the ledger's ``hops``, ``receipts`` and ``evaluations`` rows of the run (what each is:
``coordinator/audit.py``). :func:`write_bundle` and :func:`load_bundle` keep it in a file;
:func:`load_ca_file` reads ``--ca``.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fedrelay import signing
from fedrelay.signing import SignatureError

FORMAT = "fedrelay-audit-bundle"
FORMAT_VERSION = 1
ROW_TABLES = ("hops", "receipts", "evaluations")


class AuditError(ValueError):
    """The ledger or bundle cannot be read, or the run is unknown (not a verdict on its records)."""


def b64(data: bytes) -> str:
    """``data`` as base64 text (how a bundle keeps bytes)."""
    return base64.b64encode(bytes(data)).decode("ascii")


def unb64(text: str) -> bytes:
    """The bytes of a bundle's base64 ``text``; raises ``AuditError`` when it is not base64."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, AttributeError) as exc:
        raise AuditError(f"not base64: {exc}") from None


def bundle_from_ledger(db: str | Path, run_id: str) -> dict[str, Any]:
    """The audit bundle of ``run_id`` read from the SQLite ledger ``db`` (opened read-only: the
    file is never changed). Raises ``AuditError`` when the file is not a ledger or the run is
    unknown."""
    path = Path(db)
    if not path.is_file():
        raise AuditError(f"no ledger at {path} (pass --db, the file `coordinator serve --db` writes)")
    try:
        con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            return _read_bundle(con, run_id)
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise AuditError(f"cannot read the ledger {path}: {exc}") from None


def _read_bundle(con: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "runs" not in tables:
        raise AuditError("not a fedrelay ledger (it has no runs table)")

    def rows(sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in con.execute(sql, args)]

    run = rows("SELECT * FROM runs WHERE run_id = ?", (run_id,))
    if not run:
        known = [r["run_id"] for r in rows("SELECT run_id FROM runs ORDER BY created DESC LIMIT 5")]
        raise AuditError(f"unknown run {run_id!r} in this ledger" + (f" (latest: {', '.join(known)})" if known else ""))
    event_columns = {r["name"] for r in con.execute("PRAGMA table_info(events)")}
    chain_cols = ", prev_hash, hash, record" if "hash" in event_columns else ", '' AS prev_hash, '' AS hash, '' AS record"
    events = rows(f"SELECT seq, run_id, time, kind, site, message, data{chain_cols} FROM events "
                  "WHERE run_id = ? ORDER BY seq", (run_id,))
    records = rows("SELECT * FROM records WHERE run_id = ? ORDER BY seq", (run_id,)) if "records" in tables else []
    seal = rows("SELECT * FROM seals WHERE run_id = ?", (run_id,)) if "seals" in tables else []
    wanted = {r["certificate"] for r in records + seal if r["certificate"]}
    certificates = {}
    if "certificates" in tables and wanted:
        for r in rows(f"SELECT sha256, pem FROM certificates WHERE sha256 IN ({','.join('?' * len(wanted))})",
                      tuple(sorted(wanted))):
            certificates[r["sha256"]] = r["pem"]
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "run_id": run_id, "exported": time.time(),
        "run": run[0],
        "plans": rows("SELECT version, plan, time FROM plans WHERE run_id = ? ORDER BY version", (run_id,)),
        "events": events,
        "records": [{"seq": r["seq"], "type": r["type"], "signer": r["signer"], "record": b64(r["record"]),
                     "signature": b64(r["signature"]), "certificate": r["certificate"]} for r in records],
        "certificates": certificates,
        "seal": ({"seq": seal[0]["seq"], "signer": seal[0]["signer"], "record": b64(seal[0]["record"]),
                  "signature": b64(seal[0]["signature"]), "certificate": seal[0]["certificate"]} if seal else None),
        **{t: rows(f"SELECT * FROM {t} WHERE run_id = ?", (run_id,)) for t in ROW_TABLES},
    }


def write_bundle(bundle: dict[str, Any], path: str | Path) -> None:
    """Write ``bundle`` as one JSON file at ``path`` (atomically). Raises ``OSError``."""
    from fedrelay.files import atomic_write

    atomic_write(path, (json.dumps(bundle, indent=1, sort_keys=True) + "\n").encode())


def load_bundle(path: str | Path) -> dict[str, Any]:
    """An audit bundle from a JSON file. Raises ``AuditError`` when it cannot be read or is not
    a fedrelay audit bundle."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise AuditError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AuditError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AuditError(f"{path} is not a fedrelay audit bundle (`coordinator audit RUN --export FILE` writes one)")
    if doc.get("version") != FORMAT_VERSION:
        raise AuditError(f"{path} is an audit bundle of version {doc.get('version')!r}; this fedrelay reads "
                         f"version {FORMAT_VERSION}")
    missing = [k for k in ("run_id", "run", "plans", "events", "records", "certificates", "seal", *ROW_TABLES)
               if k not in doc]
    if missing:
        raise AuditError(f"{path}: the bundle lacks {', '.join(missing)}")
    return doc


def load_ca_file(path: str | Path) -> list:
    """The CA certificate(s) of ``--ca``: a PEM file, or a folder holding ``ca.pem`` (a ``--tls``
    folder) or ``ca/ca.pem`` (the PKI folder of ``init-ca``). Raises ``AuditError``."""
    p = Path(path)
    if p.is_dir():
        for candidate in (p / "ca.pem", p / "ca" / "ca.pem"):
            if candidate.is_file():
                p = candidate
                break
        else:
            raise AuditError(f"--ca {path}: no ca.pem in that folder (pass the CA certificate, ca.pem)")
    try:
        return signing.load_ca(p.read_bytes())
    except OSError as exc:
        raise AuditError(f"--ca {path}: {exc.strerror or exc}") from None
    except SignatureError as exc:
        raise AuditError(f"--ca {path}: {exc}") from None
