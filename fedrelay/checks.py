"""The rules for the numbers, enumerations and digests a site reports, beside the name rules.

``fedrelay.names`` checks the identifiers and strings that arrive over the wire; this module
adds the values of the sites' reports to the coordinator (``ReportHop``, ``ReportReceipt``,
``ReportProgress``, ``ReportFinal``, ``ReportFailure``) and of their answers to ``Evaluate``.
Each ``check_*`` of a report runs its names check first, then the values; the coordinator calls
it at the top of the servicer method, before anything is read or written. A value that breaks
its rule raises :class:`fedrelay.names.InvalidName` (a ``ValueError``) naming the field
(``fedrelay.guard`` answers it with INVALID_ARGUMENT), so nothing of the report is recorded.

The rules:

- counts (bytes, samples): ``0 <= n <= MAX_COUNT`` (2**63 - 1, the largest integer the SQLite
  ledger stores); a resumed offset is at most the payload's bytes; ``correct <= test_samples``.
- unix times (``started``, ``ended``, ``received``): finite, ``0 <= t <= MAX_UNIX_TIME``
  (2100-01-01; 0: not set).
- durations (``seconds``): finite, ``0 <= s <= MAX_SECONDS`` (a year).
- a training loss: finite. An accuracy: finite, in [0, 1]; a validation accuracy may also be
  negative (the site has no validation split).
- epochs: ``epoch <= epochs``.
- enumerations: ``purpose`` one of ``CHAIN_HOP``, ``UPLOAD``, ``FINAL_MODEL``; ``route`` one of
  ``ROUTES`` ("" means direct); a progress ``kind`` one of ``KINDS``; a reported run state one
  of ``RUN_STATES`` (the peer's states, ``peer/node.py``); a training ``stage`` a lowercase word
  (``STAGE_RE``: warmup, pool, fedseq, aggregate, or a task's own).
- digests: the sealed envelope's SHA-256 (64 lowercase hex digits; required for a relayed
  transfer); the relay's address: ``HOST:PORT`` or empty (``fedrelay.names``).

Strings are bounded by their names rules (labels 64 characters, free text
``fedrelay.names.MAX_TEXT``).
"""

from __future__ import annotations

import math
import re

from fedrelay import names
from fedrelay.names import InvalidName
from fedrelay.v1 import common_pb2

MAX_COUNT = (1 << 63) - 1
MAX_UNIX_TIME = 4_102_444_800.0  # 2100-01-01T00:00:00Z
MAX_SECONDS = 365 * 86_400.0
PURPOSES = (common_pb2.CHAIN_HOP, common_pb2.UPLOAD, common_pb2.FINAL_MODEL)
ROUTES = ("", "direct", "relayed")
KINDS = ("state", "epoch")
RUN_STATES = ("assigned", "receiving", "training", "sending", "distributing", "done", "failed", "ended")
STAGE_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")


# -- single values ---------------------------------------------------------------------------------
def check_count(n: int, field: str, maximum: int = MAX_COUNT) -> int:
    """An integer count ``0 <= n <= maximum`` (default ``MAX_COUNT``). Returns it; raises ``InvalidName``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= maximum:
        raise InvalidName(field, f"an integer from 0 to {maximum}", n)
    return n


def check_number(x: float, field: str, low: float = -math.inf, high: float = math.inf, what: str = "") -> float:
    """A finite number in ``[low, high]``. Returns it; raises ``InvalidName`` (``what``: the
    rule's words, e.g. "a duration in seconds from 0 to 31536000")."""
    if (not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x)
            or not low <= x <= high):
        rule = what or ("a finite number" + (f" from {low:g} to {high:g}" if math.isfinite(low) and math.isfinite(high)
                                             else f" >= {low:g}" if math.isfinite(low)
                                             else f" <= {high:g}" if math.isfinite(high) else ""))
        raise InvalidName(field, rule, x)
    return x


def check_unix_time(t: float, field: str) -> float:
    """Unix seconds: finite, ``0 <= t <= MAX_UNIX_TIME`` (0: not set). Raises ``InvalidName``."""
    return check_number(t, field, 0.0, MAX_UNIX_TIME, f"unix seconds from 0 to {MAX_UNIX_TIME:.0f} (2100-01-01)")


def check_seconds(s: float, field: str = "seconds") -> float:
    """A duration: finite, ``0 <= s <= MAX_SECONDS``. Raises ``InvalidName``."""
    return check_number(s, field, 0.0, MAX_SECONDS, f"a duration in seconds from 0 to {MAX_SECONDS:.0f}")


def check_fraction(x: float, field: str) -> float:
    """An accuracy: finite, in [0, 1]. Raises ``InvalidName``."""
    return check_number(x, field, 0.0, 1.0, "a finite number from 0 to 1")


def check_choice(value, field: str, choices) -> None:
    """One of ``choices`` (an enumeration). Raises ``InvalidName``."""
    if value not in choices:
        raise InvalidName(field, "one of " + ", ".join(repr(c) for c in choices), value)


def check_purpose(p: int, field: str = "purpose") -> int:
    """A ``Purpose``: CHAIN_HOP, UPLOAD or FINAL_MODEL. Raises ``InvalidName``."""
    if p not in PURPOSES:
        raise InvalidName(field, "CHAIN_HOP, UPLOAD or FINAL_MODEL", p)
    return p


def check_relay(route: str, relay: str, sealed_bytes: int, sealed_sha256: str) -> None:
    """A sender's route fields: ``route`` in ``ROUTES``; ``relay`` empty or ``HOST:PORT``;
    ``sealed_sha256`` empty or a SHA-256, and set (with ``sealed_bytes`` > 0) when relayed."""
    check_choice(route, "route", ROUTES)
    if relay:
        names.check_address(relay, "relay")
    check_count(sealed_bytes, "sealed_bytes")
    names.check_sha256(sealed_sha256, "sealed_sha256", optional=route != "relayed")
    if route == "relayed" and not sealed_bytes:
        raise InvalidName("sealed_bytes", "the sealed envelope's size (> 0) for a relayed transfer", sealed_bytes)


# -- the reports (one call at the top of each Coordinator.Report* method) ---------------------------
def check_hop_report(r) -> None:
    """``Coordinator.ReportHop``'s ``HopReport``: the names (``names.check_hop_report``), the
    purpose, byte counts, unix times, route and relay fields."""
    names.check_hop_report(r)
    check_purpose(r.purpose)
    check_count(r.payload_bytes, "payload_bytes")
    check_count(r.wire_bytes, "wire_bytes")
    check_count(r.resumed_from, "resumed_from", r.payload_bytes)
    check_unix_time(r.started, "started")
    check_unix_time(r.ended, "ended")
    check_relay(r.route, r.relay, r.sealed_bytes, r.sealed_sha256)


def check_receipt(r) -> None:
    """``Coordinator.ReportReceipt``'s ``ReceiptReport``: the names, the purpose, byte counts,
    the time received and the route."""
    names.check_receipt(r)
    check_purpose(r.purpose)
    check_count(r.payload_bytes, "payload_bytes")
    check_unix_time(r.received, "received")
    check_choice(r.route, "route", ROUTES)
    check_count(r.relay_wire_bytes, "relay_wire_bytes")


def check_progress(r) -> None:
    """``Coordinator.ReportProgress``'s ``ProgressReport``: the names and labels, the kind; a
    state report's state; an epoch's stage, epoch numbers, loss, accuracy and seconds."""
    names.check_progress(r)
    check_choice(r.kind, "kind", KINDS)
    if r.kind == "state":
        check_choice(r.state, "state", RUN_STATES)
        return
    if not STAGE_RE.fullmatch(r.stage):
        raise InvalidName("stage", "a lowercase word of at most 32 characters (warmup, pool, fedseq, aggregate...)",
                          r.stage)
    if r.epoch > r.epochs:
        raise InvalidName("epoch", f"at most epochs ({r.epochs})", r.epoch)
    check_number(r.train_loss, "train_loss")
    if not (math.isfinite(r.val_accuracy) and r.val_accuracy < 0):  # negative: no validation split
        check_fraction(r.val_accuracy, "val_accuracy")
    check_seconds(r.seconds)


def check_final(r) -> None:
    """``Coordinator.ReportFinal``'s ``FinalReport``: the names and the model's size."""
    names.check_final(r)
    check_count(r.model_bytes, "model_bytes")


def check_failure(r) -> None:
    """``Coordinator.ReportFailure``'s ``FailureReport``: run id, site, error text (at most
    ``names.MAX_TEXT`` characters)."""
    names.check_failure(r)


def check_evaluation(reply, site: str) -> None:
    """A site's ``EvaluateReply``: sample counts (``correct <= test_samples``), an accuracy in
    [0, 1], seconds. ``site``: the site asked (named in the message). Raises ``InvalidName``
    with fields ``SITE's EvaluateReply.FIELD``."""
    field = f"{site}'s EvaluateReply."
    check_count(reply.test_samples, field + "test_samples")
    check_count(reply.correct, field + "correct")
    if reply.correct > reply.test_samples:
        raise InvalidName(field + "correct", f"at most test_samples ({reply.test_samples})", reply.correct)
    check_fraction(reply.accuracy, field + "accuracy")
    check_seconds(reply.seconds, field + "seconds")
