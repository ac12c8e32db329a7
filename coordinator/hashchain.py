"""The ledger's hash chain: each run's events, linked by SHA-256.

Every row of the ledger's ``events`` table stores ``prev_hash`` (the ``hash`` of the run's
previous event; for its first event, :func:`genesis` of the run id) and ``hash``::

    hash = SHA-256( "fedrelay ledger event v1\\n" || bytes(prev_hash) || canonical(event) )

where ``canonical(event)`` is the JSON object of the event's ``run_id``, ``time`` (unix seconds,
a float written as Python's shortest round-trip repr), ``kind``, ``site``, ``message``, ``data``
(the stored JSON text, as a string) and ``record`` (the binding digest of the signed record the
event carries, ``fedrelay.signing.SignedRecord.binding``, or ""), with sorted keys, no spaces and
ASCII only. So an edited event no longer matches its hash, a dropped or moved one breaks the next
event's link, and a signed record is bound to the place in the chain where it was recorded. The
chain is per run, so a run's audit bundle holds that run's events only. The coordinator signs
the chain's head when the run ends (``RunSeal``), which also covers events dropped at the end.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

EVENT_FIELDS = ("run_id", "time", "kind", "site", "message", "data", "record")


def genesis(run_id: str) -> str:
    """The ``prev_hash`` of a run's first event (hex)."""
    return hashlib.sha256(b"fedrelay ledger chain v1\n" + run_id.encode()).hexdigest()


def canonical_event(event: dict[str, Any]) -> bytes:
    """The bytes of an event that its hash covers (see the module's docstring); ``event`` holds
    :data:`EVENT_FIELDS` (``record`` may be missing: "")."""
    body = {k: event.get(k, "") if k == "record" else event[k] for k in EVENT_FIELDS}
    body["time"] = float(body["time"])
    body["record"] = body["record"] or ""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def event_hash(prev_hash: str, event: dict[str, Any]) -> str:
    """The ``hash`` of ``event`` after the event whose hash is ``prev_hash`` (hex). Raises
    ``ValueError`` when ``prev_hash`` is not hex."""
    return hashlib.sha256(b"fedrelay ledger event v1\n" + bytes.fromhex(prev_hash)
                          + canonical_event(event)).hexdigest()


# The columns of a run's row that the coordinator's RunSeal covers, as stored (JSON columns as
# their text). The sizes and schemas that the first agreed transfer fixes (model_bytes,
# schema_sha256, upload_*) are left out: a late report may still set them after the run ended,
# and the signed reports prove them anyway.
SEALED_RUN_FIELDS = ("run_id", "created", "ended", "status", "strategy", "arch", "seed", "params", "chain",
                     "class_index", "model", "warnings", "insecure", "rounds", "final_sha256", "final_site",
                     "accuracy", "error", "cancelled_by", "cancel_reason", "task", "task_version", "task_sha256",
                     "metrics", "started_by", "refused_by", "refusal", "refused_by_policy")
# Columns sealed since site policies and several operators (docs/site-policy.md): a seal written
# before them does not hold them, and is checked without them.
SEALED_SINCE_POLICY = frozenset({"started_by", "refused_by", "refusal", "refused_by_policy"})


def sealed_run(row: dict[str, Any]) -> str:
    """A run's row (the ledger's ``runs`` columns, JSON columns as their stored text) as the
    canonical JSON its seal holds: :data:`SEALED_RUN_FIELDS`, sorted keys, no spaces."""
    return json.dumps({k: row.get(k) for k in SEALED_RUN_FIELDS}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)


def plan_digest(plan_json: str) -> str:
    """SHA-256 (hex) of a plan version as the ledger stores it (its JSON text)."""
    return hashlib.sha256(plan_json.encode()).hexdigest()
