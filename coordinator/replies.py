"""The operator's replies kept under gRPC's message cap: bounded run summaries and pages.

Every channel caps a message at ``calls.MAX_MESSAGE_BYTES`` (8 MiB); a reply over it fails at
the client (RESOURCE_EXHAUSTED) and the operator could no longer list the runs. What a reply
holds grows with what sites reported (a run's error text, its sites' live details, its
transfers) and with the ledger (runs, peers, metric rows), so:

- :func:`bounded_summary`: a ``RunSummary`` over ``SUMMARY_BYTES`` has its free text cut to
  ``TEXT_CHARS`` characters each (error, cancel reason, warnings, live details and lines);
  if it is still over, its longest lists are cut in half until it fits, and a warning says what
  was left out (``coordinator show --json`` of such a run is incomplete, the ledger is not).
- :func:`page`: ``ListRuns``, ``ListPeers`` and ``GetMetrics`` answer in pages of at most
  ``PAGE_BYTES`` (and at least one item); the reply names where the next page starts
  (``next_after`` / ``next_offset``) and the client asks again (``coordinator/client.py``).
- :func:`bounded_peer`: a ``PeerRecord`` too big for one reply (tens of thousands of long class
  names in its task offers) keeps the classes that fit; ``classes_omitted`` says how many it
  left out.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from fedrelay.calls import MAX_MESSAGE_BYTES
from fedrelay.v1 import coordinator_pb2 as cpb

PAGE_BYTES = MAX_MESSAGE_BYTES // 2  # bytes of items in one page of a listing
SUMMARY_BYTES = MAX_MESSAGE_BYTES - (256 << 10)  # one RunSummary at most (room for the reply's framing)
TEXT_CHARS = 2_000  # characters of one free-text field kept in a summary cut to size
# The lists of a summary that may be cut, in the order they are cut.
# (The class index last: fetch-model writes it into the model file's metadata.)
LISTS = ("live", "warnings", "hops", "uploads", "final_transfers", "plan", "skipped", "contributors", "class_index")

T = TypeVar("T")


def _cut(text: str, chars: int = TEXT_CHARS) -> str:
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text)} characters)"


def bounded_summary(s: cpb.RunSummary, budget: int | None = None) -> cpb.RunSummary:
    """``s`` itself when it serializes to at most ``budget`` bytes (default ``SUMMARY_BYTES``);
    else ``s`` cut to fit (see the module docstring), changed in place and returned."""
    budget = SUMMARY_BYTES if budget is None else budget
    if s.ByteSize() <= budget:
        return s
    s.error, s.cancel_reason = _cut(s.error), _cut(s.cancel_reason)
    s.warnings[:] = [_cut(w) for w in s.warnings]
    for v in s.live:
        v.detail, v.line = _cut(v.detail), _cut(v.line)
    left_out: dict[str, int] = {}
    room = budget - (4 << 10)  # for the warning that says what was left out
    for name in LISTS:
        field = getattr(s, name)
        while s.ByteSize() > room and len(field):
            keep = len(field) // 2
            left_out[name] = left_out.get(name, 0) + len(field) - keep
            del field[keep:]
    if s.ByteSize() > room and len(s.final.per_site):
        left_out["final.per_site"] = len(s.final.per_site)
        s.final.per_site.clear()
    if left_out:
        s.warnings.append("this summary is cut to fit a reply: it leaves out "
                          + ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in left_out.items())
                          + " (the ledger holds them all)")
    return s


def page(items: Iterable[T], size: Callable[[T], int], budget: int | None = None) -> tuple[list[T], bool]:
    """The first items of ``items`` whose ``size`` (bytes) add up to at most ``budget`` (default
    ``PAGE_BYTES``; at least one item), and whether any item is left after them. Consumes
    ``items`` lazily: an item past the page is built but not kept."""
    budget = PAGE_BYTES if budget is None else budget
    out: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if out and total + n > budget:
            return out, True
        out.append(item)
        total += n
    return out, False


def bounded_peer(record: cpb.PeerRecord, budget: int | None = None) -> cpb.PeerRecord:
    """``record`` cut to ``budget`` bytes (default ``SUMMARY_BYTES``) when it is over: the class
    lists of its largest task offers halved (``classes_omitted`` counts what was left out), then,
    if still over, the input and statistics descriptions of its largest offers cleared. Changed
    in place and returned. (A registration is under the message cap itself, so this is rare.)"""
    budget = SUMMARY_BYTES if budget is None else budget
    while record.ByteSize() > budget:
        offers = [o for o in record.tasks if len(o.classes)]
        if not offers:
            break
        offer = max(offers, key=lambda o: o.ByteSize())
        keep = len(offer.classes) // 2
        record.classes_omitted += len(offer.classes) - keep
        del offer.classes[keep:]
    for offer in sorted(record.tasks, key=lambda o: o.ByteSize(), reverse=True):
        if record.ByteSize() <= budget:
            break
        offer.input_json = offer.stats_json = ""
    return record
