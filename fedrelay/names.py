"""The rules for identifiers, names and strings that arrive over the wire.

Every such value is checked here before it reaches a path, a log line or the ledger; a value
that breaks its rule raises :class:`InvalidName` (a ``ValueError``) whose message names the
field, states the rule and shows at most 40 characters of the value (ASCII-escaped). The daemons
answer it with INVALID_ARGUMENT (``fedrelay.guard`` turns an ``InvalidName`` raised by a servicer
method into that status; ``peer.transfer.check_header_fields`` into a ``TransferError``).

The rules (lengths in characters):

- run id: 1-64 of ``A-Z a-z 0-9 _ -``, starting with a letter or digit (the coordinator makes
  ``20261123-061500-ab12cd``); it names a folder on every site.
- site name: a DNS label, 1-63 of ``a-z 0-9 -``, not starting or ending with ``-`` (``site-00``,
  ``hospital-a``). It is also the certificate name ``coordinator enroll`` issues.
- class name: 1-128 printable characters (``str.isprintable``: no newline, NUL or other control
  or format character), no ``/`` or ``\\``, not starting with ``.``, no leading or trailing
  space; a class index has no duplicates and at most ``MAX_CLASSES`` names. Class names are
  the sites' class folder names (``T-shirt_top``).
- SHA-256: 64 lowercase hex digits.
- address: ``HOST:PORT``, HOST a DNS name or IPv4 address (``A-Z a-z 0-9 . -``, at most 253) or
  a bracketed IPv6 address, PORT 1-65535.
- chain positions: below ``MAX_SITES`` (a chain has at most that many sites, and so do lists of
  sites: order, skipped sites, peers); transfer indices (hop numbers, across rounds) below
  ``MAX_HOP``; a site's part of a plan holds at most ``MAX_TRANSFERS`` transfers.
- label (strategy, arch, device, version, state, status, ...): at most 64 printable characters.
- free text (a failure's error, a state's detail, an end notice's reason): at most
  ``MAX_TEXT`` characters, no control character other than tab, newline and carriage return.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Iterable

MAX_RUN_ID = 64
MAX_SITE_NAME = 63
MAX_CLASS_NAME = 128
MAX_CLASSES = 65_536
MAX_SITES = 1_024
MAX_HOP = 1 << 20          # T·N, with fedrelay.params.MAX_ROUNDS and MAX_SITES, stays below it
MAX_TRANSFERS = 1 << 16
MAX_HOST = 253
MAX_LABEL = 64
MAX_TEXT = 16_384
SHOWN = 40  # characters of a refused value quoted in the message

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SITE_NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_TEXT_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def shown(value) -> str:
    """``value`` for an error message: ASCII-escaped, cut to ``SHOWN`` characters, and the escaped
    form to ``3 * SHOWN`` (one astral character escapes to 10)."""
    if not isinstance(value, str):
        return ascii(value)
    text = ascii(value[:SHOWN])
    cut = len(value) > SHOWN or len(text) > 3 * SHOWN
    if len(text) > 3 * SHOWN:
        text = text[:3 * SHOWN] + "'"
    return f"{text}... ({len(value)} characters)" if cut else text


class InvalidName(ValueError):
    """A value from the wire that breaks its rule. ``field`` names it (e.g. ``run_id``,
    ``header.sender``, ``class_index[3]``); the message says ``FIELD must be RULE (got VALUE)``."""

    def __init__(self, field: str, rule: str, value=None):
        super().__init__(f"{field} must be {rule} (got {shown(value)})")
        self.field = field


# -- single values ---------------------------------------------------------------------------------
def check_run_id(s: str, field: str = "run_id") -> str:
    """A run id (module docstring). Returns it; raises ``InvalidName``."""
    if not isinstance(s, str) or not RUN_ID_RE.fullmatch(s):
        raise InvalidName(field, f"1-{MAX_RUN_ID} characters of A-Z, a-z, 0-9, '_' and '-', starting with a "
                                 "letter or digit", s)
    return s


def check_site_name(s: str, field: str = "site") -> str:
    """A site name: a DNS label of 1-63 characters (module docstring). Returns it; raises ``InvalidName``."""
    if not isinstance(s, str) or not SITE_NAME_RE.fullmatch(s):
        raise InvalidName(field, f"a site name: 1-{MAX_SITE_NAME} characters of a-z, 0-9 and '-', not starting "
                                 "or ending with '-'", s)
    return s


def check_class_name(s: str, field: str = "class name") -> str:
    """A class name (module docstring). Returns it; raises ``InvalidName``."""
    if (not isinstance(s, str) or not 1 <= len(s) <= MAX_CLASS_NAME or not s.isprintable()
            or "/" in s or "\\" in s or s.startswith(".") or s != s.strip()):
        raise InvalidName(field, f"a class name: 1-{MAX_CLASS_NAME} printable characters, no '/' or '\\', "
                                 "not starting with '.', no leading or trailing space", s)
    return s


def check_sha256(s: str, field: str = "sha256", *, optional: bool = False) -> str:
    """64 lowercase hex digits (or, when ``optional``, empty). Returns it; raises ``InvalidName``."""
    if optional and s == "":
        return s
    if not isinstance(s, str) or not SHA256_RE.fullmatch(s):
        raise InvalidName(field, "64 lowercase hex digits" + (" or empty" if optional else ""), s)
    return s


def check_address(s: str, field: str = "address") -> str:
    """``HOST:PORT`` (module docstring). Returns it; raises ``InvalidName``."""
    rule = (f"HOST:PORT with a DNS name, IPv4 address (at most {MAX_HOST} characters) or [IPv6] "
            "address as HOST and PORT 1-65535")
    host, sep, port = s.rpartition(":") if isinstance(s, str) else ("", "", "")
    if not sep or not port.isascii() or not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535:
        raise InvalidName(field, rule, s)
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidName(field, rule, s) from None
    elif not HOST_RE.fullmatch(host):
        raise InvalidName(field, rule, s)
    return s


def check_index(n: int, field: str) -> int:
    """A chain position or length: 0 <= n < ``MAX_SITES``. Returns it; raises ``InvalidName``."""
    if not 0 <= n < MAX_SITES:
        raise InvalidName(field, f"below {MAX_SITES}", n)
    return n


def check_label(s: str, field: str, max_chars: int = MAX_LABEL) -> str:
    """A short label (strategy, device, state...): at most ``max_chars`` printable characters,
    possibly empty. Returns it; raises ``InvalidName``."""
    if not isinstance(s, str) or len(s) > max_chars or not s.isprintable():
        raise InvalidName(field, f"at most {max_chars} printable characters", s)
    return s


def check_text(s: str, field: str, max_chars: int = MAX_TEXT) -> str:
    """Free text (an error message, a detail): at most ``max_chars`` characters, no control
    character but tab, newline and carriage return. Returns it; raises ``InvalidName``."""
    if not isinstance(s, str) or len(s) > max_chars or _TEXT_CONTROL_RE.search(s):
        raise InvalidName(field, f"at most {max_chars} characters of text without control characters", s)
    return s


def check_site_names(names: Iterable[str], field: str) -> list[str]:
    """A list of distinct site names, at most ``MAX_SITES``. Returns it; raises ``InvalidName``."""
    names = list(names)
    if len(names) > MAX_SITES:
        raise InvalidName(field, f"at most {MAX_SITES} sites", f"{len(names)} sites")
    for i, name in enumerate(names):
        check_site_name(name, f"{field}[{i}]")
    if len(set(names)) != len(names):
        raise InvalidName(field, "distinct site names", next(n for n in names if names.count(n) > 1))
    return names


def check_class_names(names: Iterable[str], field: str = "class_index") -> list[str]:
    """A list of distinct class names, at most ``MAX_CLASSES``. Returns it; raises ``InvalidName``."""
    names = list(names)
    if len(names) > MAX_CLASSES:
        raise InvalidName(field, f"at most {MAX_CLASSES} class names", f"{len(names)} names")
    seen: set[str] = set()
    for i, name in enumerate(names):
        check_class_name(name, f"{field}[{i}]")
        if name in seen:
            raise InvalidName(field, "distinct class names", name)
        seen.add(name)
    return names


def check_site_ref(ref, field: str, *, required: bool = False) -> None:
    """A ``SiteRef`` (a name, and an address unless the site connects out only: ""); an unset one
    (empty name and address) passes unless ``required``. Raises ``InvalidName``."""
    if not required and not ref.name and not ref.address:
        return
    check_site_name(ref.name, f"{field}.name")
    if ref.address:
        check_address(ref.address, f"{field}.address")


def _check_site_refs(refs, field: str) -> None:
    if len(refs) > MAX_SITES:
        raise InvalidName(field, f"at most {MAX_SITES} sites", f"{len(refs)} sites")
    for i, ref in enumerate(refs):
        check_site_ref(ref, f"{field}[{i}]", required=True)


def check_hop(n: int, field: str = "hop") -> int:
    """A transfer index (a hop number across rounds, or 0): below ``MAX_HOP``. Raises ``InvalidName``."""
    if not isinstance(n, int) or not 0 <= n < MAX_HOP:
        raise InvalidName(field, f"a transfer index below {MAX_HOP}", n)
    return n


def check_part(m) -> None:
    """A site's part of a plan (``transfers``, ``peers``, ``visits`` of an Assignment or a
    RerouteRequest). Raises ``InvalidName``."""
    if len(m.transfers) > MAX_TRANSFERS:
        raise InvalidName("transfers", f"at most {MAX_TRANSFERS} transfers", f"{len(m.transfers)} transfers")
    for i, t in enumerate(m.transfers):
        check_hop(t.index, f"transfers[{i}].index")
        check_hop(t.round, f"transfers[{i}].round")
        check_site_name(t.sender, f"transfers[{i}].sender")
        check_site_name(t.receiver, f"transfers[{i}].receiver")
    _check_site_refs(m.peers, "peers")
    if len(m.visits) > MAX_SITES:
        raise InvalidName("visits", f"at most {MAX_SITES} rounds", f"{len(m.visits)} rounds")


# -- messages (one call at the top of each servicer method) ----------------------------------------
def check_assignment(a) -> None:
    """``Peer.Assign``'s ``Assignment``: run id, site names, its part of the plan, class index, labels."""
    check_run_id(a.run_id)
    check_site_name(a.site, "site")
    check_index(a.position, "position")
    check_index(a.chain_length, "chain_length")
    check_site_names(a.order, "order")
    check_part(a)
    check_class_names(a.class_index)
    check_model_spec(a.model, "model")
    check_params(a.params)
    if a.aggregator:
        check_site_name(a.aggregator, "aggregator")
    check_text(a.operator, "operator", max_chars=200)


MAX_METHOD_OPTIONS = 64     # entries of TrainingParams.method_options
MAX_OPTION_TEXT = 1_024     # characters of one method option's value


def check_params(p) -> None:
    """A ``TrainingParams``' string fields: labels; its ``method_options``: at most
    ``MAX_METHOD_OPTIONS`` entries, each a label naming the option and text (their values are
    checked by fedrelay.params)."""
    for field in p.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING:
            check_label(getattr(p, field.name), f"params.{field.name}")
    if len(p.method_options) > MAX_METHOD_OPTIONS:
        raise InvalidName("params.method_options", f"at most {MAX_METHOD_OPTIONS} entries",
                          f"{len(p.method_options)} entries")
    for key, value in p.method_options.items():
        check_label(key, "params.method_options")
        check_text(value, f"params.method_options[{key}]", max_chars=MAX_OPTION_TEXT)


def check_transfer_header(h) -> None:
    """A ``TransferHeader`` (Handoff, TransferOffset, FetchModel streams): run id, sender, hop,
    SHA-256. Field names are ``header.*``."""
    check_run_id(h.run_id, "header.run_id")
    check_site_name(h.sender, "header.sender")
    check_hop(h.hop, "header.hop")
    check_sha256(h.sha256, "header.sha256")


def check_run_request(r) -> None:
    """Requests naming a run and maybe a model (Evaluate, FetchModel, GetRun, WatchRun): the run
    id, and ``sha256`` (empty or 64 hex digits) when the message has one."""
    check_run_id(r.run_id)
    if hasattr(r, "sha256"):
        check_sha256(r.sha256, optional=True)


def check_reroute(r) -> None:
    """``Peer.Reroute``'s ``RerouteRequest``: run id, skipped sites, the new part of the plan."""
    check_run_id(r.run_id)
    check_site_names(r.skipped, "skipped")
    check_part(r)


def check_end_run(r) -> None:
    """``Peer.EndRun``'s ``EndRunRequest``: run id, status label, reason text."""
    check_run_id(r.run_id)
    check_label(r.status, "status")
    check_text(r.reason, "reason")
    check_label(r.cancelled_by, "cancelled_by")


MAX_TASKS = 64          # tasks one site may offer
MAX_TASK_JSON = 1 << 20  # bytes of a task's input or statistics description


def check_task_name(s: str, field: str) -> str:
    """A task's name (``fedrelay.tasks.check_name``). Returns it; raises ``InvalidName``."""
    from fedrelay import tasks

    try:
        tasks.check_name(s, field)
    except ValueError:
        raise InvalidName(field, "a task name: letters, digits, '-', '_', '.' or module:attr, at most "
                                 f"{tasks.MAX_NAME} characters", s) from None
    return s


def check_model_spec(m, field: str) -> None:
    """A ``ModelSpec``: task name, model label, digest (64 hex digits or empty), JSON size."""
    check_task_name(m.task, f"{field}.task")
    check_label(m.model, f"{field}.model")
    check_label(m.task_version, f"{field}.task_version")
    check_sha256(m.task_sha256, f"{field}.task_sha256", optional=True)
    if len(m.input_json) > MAX_TASK_JSON:
        raise InvalidName(f"{field}.input_json", f"at most {MAX_TASK_JSON} bytes", f"{len(m.input_json)} bytes")


def check_task_offer(t, field: str) -> None:
    """One ``TaskOffer`` of a registration: names, digest, class names, JSON sizes, error text."""
    check_task_name(t.name, f"{field}.name")
    check_label(t.version, f"{field}.version")
    check_sha256(t.sha256, f"{field}.sha256", optional=True)
    for i, m in enumerate(t.models):
        check_label(m, f"{field}.models[{i}]")
    check_class_names([c.name for c in t.classes], f"{field}.classes")
    for key in ("input_json", "stats_json"):
        if len(getattr(t, key)) > MAX_TASK_JSON:
            raise InvalidName(f"{field}.{key}", f"at most {MAX_TASK_JSON} bytes", f"{len(getattr(t, key))} bytes")
    check_text(t.error, f"{field}.error")
    if t.positive_class:
        check_class_name(t.positive_class, f"{field}.positive_class")


def check_registration(r) -> None:
    """``Coordinator.Register``'s ``RegisterRequest``: name, address (none for a site that only
    connects out), the task offers, labels."""
    check_site_name(r.name, "name")
    if r.address or not getattr(r, "outbound_only", False):
        check_address(r.address, "address")
    if len(r.tasks) > MAX_TASKS:
        raise InvalidName("tasks", f"at most {MAX_TASKS} tasks", f"{len(r.tasks)} tasks")
    for i, t in enumerate(r.tasks):
        check_task_offer(t, f"tasks[{i}]")
    check_label(r.device, "device")
    check_label(r.version, "version")
    check_label(r.instance, "instance")


def _check_transfer(r, schema_optional: bool) -> None:
    """A reported transfer: run id, sender, receiver, hop, the payload's SHA-256 and its
    schema's (``schema_sha256``, which may be empty when ``schema_optional``)."""
    check_run_id(r.run_id)
    check_site_name(r.sender, "sender")
    check_site_name(r.receiver, "receiver")
    check_hop(r.hop, "hop")
    check_sha256(r.sha256)
    check_sha256(r.schema_sha256, "schema_sha256", optional=schema_optional)


def check_hop_report(r) -> None:
    """``Coordinator.ReportHop``'s ``HopReport``: run id, sender, receiver, hop, SHA-256."""
    _check_transfer(r, schema_optional=True)


def check_receipt(r) -> None:
    """``Coordinator.ReportReceipt``'s ``ReceiptReport``: run id, sender, receiver, hop, digests."""
    _check_transfer(r, schema_optional=False)


def check_progress(r) -> None:
    """``Coordinator.ReportProgress``'s ``ProgressReport``: run id, site, labels, detail text."""
    check_run_id(r.run_id)
    check_site_name(r.site)
    for name in ("kind", "stage", "state"):
        check_label(getattr(r, name), name)
    check_text(r.detail, "detail")


def check_final(r) -> None:
    """``Coordinator.ReportFinal``'s ``FinalReport``: run id, site, SHA-256, missing sites."""
    check_run_id(r.run_id)
    check_site_name(r.site)
    check_sha256(r.sha256)
    check_site_names(r.missing, "missing")


def check_failure(r) -> None:
    """``Coordinator.ReportFailure``'s ``FailureReport``: run id, site, error text."""
    check_run_id(r.run_id)
    check_site_name(r.site)
    check_text(r.error, "error")


def check_resolve(r) -> None:
    """``Coordinator.ResolveSite``'s request: the site name."""
    check_site_name(r.name, "name")


def check_start_chain(r) -> None:
    """``Coordinator.StartChain``'s request: the sites named, order, task and model labels."""
    check_site_names(r.peers, "peers")
    check_label(r.order, "order")
    check_label(r.model, "model")
    if r.task:
        check_task_name(r.task, "task")
    check_sha256(r.task_sha256, "task_sha256", optional=True)
    check_params(r.params)
    if r.aggregator:
        check_site_name(r.aggregator, "aggregator")
