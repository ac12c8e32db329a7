"""The transfers in the ledger: what the senders reported (``hops``) and what the receivers
attested (``receipts``) of each planned transfer, and whether the two ends agree.

A transfer is *done* only when both ends agree on sender, bytes, SHA-256 and schema
(:func:`transfer_status`); a report that contradicts one already recorded raises
:class:`LedgerConflict` and overwrites nothing.
"""

from __future__ import annotations

from typing import Any

from fedrelay.coordinator.ledger_store import Store

SENDER_SIDE = ("sender", "payload_bytes", "sha256", "schema_sha256")


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


def _unsent(run_id: str, purpose: str, hop: int, receiver: str, sender: str) -> dict[str, Any]:
    """The sender's columns of a transfer only its receiver has reported (None or empty)."""
    return {"run_id": run_id, "purpose": purpose, "hop": hop, "receiver": receiver, "sender": sender,
            "payload_bytes": None, "wire_bytes": None, "sha256": None, "started": None, "ended": None,
            "attempts": 0, "resumed_from": 0, "round": None, "schema_sha256": "", **_UNSENT}


class TransferRecords:
    """The ``hops`` and ``receipts`` tables of the ledger in ``store``."""

    def __init__(self, store: Store):
        self._store = store
        self._db = store.db
        self._lock = store.lock

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
        sent = {(r["hop"], r["receiver"]): r for r in self._store.all(
            "SELECT * FROM hops WHERE run_id = ? AND purpose = ?", (run_id, purpose))}
        got = {(r["hop"], r["receiver"]): r for r in self._store.all(
            "SELECT * FROM receipts WHERE run_id = ? AND purpose = ?", (run_id, purpose))}
        out = []
        for key in sorted(set(sent) | set(got)):
            row = dict(sent.get(key) or _unsent(run_id, purpose, key[0], key[1], got[key]["sender"]))
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
            sent = self._store.all(f"SELECT * FROM hops {where}", key)
            got = self._store.all(f"SELECT * FROM receipts {where}", key)
        if not sent and not got:
            return None
        row = dict(sent[0] if sent else _unsent(run_id, purpose, hop, receiver, got[0]["sender"]))
        row["receipt"] = got[0] if got else None
        row["status"] = transfer_status(sent[0] if sent else None, row["receipt"])
        return row

    def transfer_totals(self) -> dict[str, dict[str, int]]:
        """Every run's transfers as their senders reported them, by purpose (chain|upload|final):
        ``{purpose: {"transfers", "payload_bytes", "wire_bytes", "retries" (streams beyond the
        first), "resumed_bytes" (bytes the receivers already held when the last stream began)}}``."""
        rows = self._store.all("""SELECT purpose, COUNT(*) AS transfers, SUM(payload_bytes) AS payload_bytes,
                                   SUM(wire_bytes) AS wire_bytes, SUM(MAX(attempts, 1) - 1) AS retries,
                                   SUM(resumed_from) AS resumed_bytes FROM hops GROUP BY purpose""")
        return {r.pop("purpose"): r for r in rows}
