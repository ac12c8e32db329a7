"""The run page's data (``/api/runs/{id}``) built once per change of the run, not per reader.

Building a run's view reads the ledger (summary, hops, metrics) and encodes a JSON object that
grows with the run; 30 readers of one run's page saturated the coordinator's web thread in the
hostile trial. :class:`PageCache` keeps each run's encoded view with the key it was built for:
the run's newest event seq in the event hub (``EventHub.last_seq``) and whether the run has
ended. A reader whose run has the same key gets the cached bytes; only one reader per run
builds at a time (the others wait for it and reuse its result). A view older than ``max_age``
seconds is rebuilt too (a ledger write that adds no event). The view's ``now`` (unix seconds)
is added per response.

Values that JSON cannot carry (an infinite or NaN float from an older ledger) become ``null``
(:func:`finite`), so a run's page data never answers HTTP 500.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from typing import Any, Callable


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (inf, -inf, nan) inside dicts, lists and tuples
    replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def encode(view: dict) -> bytes:
    """A view as compact JSON bytes (non-finite floats as null)."""
    return json.dumps(finite(view), separators=(",", ":"), allow_nan=False).encode()


class PageCache:
    """Encoded run views by run id, at most ``size`` runs (least recently read dropped first).

    ``build(run_id)``: the run's view as a dict (``views.run_view``), None for an unknown run;
    ``key(run_id)``: what changes when the run changes (hashable). ``stamp``: add ``now`` to
    each response (False for a view that is not a JSON object, e.g. the run list). ``builds``
    counts the views built (for tests)."""

    def __init__(self, build: Callable[[str], Any], key: Callable[[str], Any], *, size: int = 64,
                 max_age: float = 5.0, clock=time.monotonic, stamp: bool = True):
        self.build, self.key, self.size, self.max_age, self.clock = build, key, size, max_age, clock
        self.stamp = stamp  # add ``now`` to each response (views that are JSON objects)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[Any, float, bytes]] = OrderedDict()
        self._building: dict[str, threading.Lock] = {}
        self.builds = 0

    def _fresh(self, run_id: str, key: Any) -> bytes | None:
        with self._lock:
            entry = self._entries.get(run_id)
            if entry is None or entry[0] != key or self.clock() - entry[1] > self.max_age:
                return None
            self._entries.move_to_end(run_id)
            return entry[2]

    def get(self, run_id: str) -> bytes | None:
        """The run's view as JSON bytes with ``now`` set, or None for an unknown run."""
        key = self.key(run_id)
        body = self._fresh(run_id, key)
        if body is None:
            with self._lock:
                building = self._building.setdefault(run_id, threading.Lock())
            with building:  # one builder per run; the others wait and take its result
                body = self._fresh(run_id, key)
                if body is None:
                    view = self.build(run_id)
                    if view is None:
                        with self._lock:
                            if run_id not in self._entries:
                                self._building.pop(run_id, None)
                        return None
                    if self.stamp:
                        view.pop("now", None)
                    body = encode(view)
                    with self._lock:
                        self.builds += 1
                        self._entries[run_id] = (key, self.clock(), body)
                        self._entries.move_to_end(run_id)
                        while len(self._entries) > self.size:
                            old, _ = self._entries.popitem(last=False)
                            self._building.pop(old, None)
        if not self.stamp:
            return body
        # ``now`` is added per response: the cached body ends with the object's closing brace.
        return body[:-1] + (b"," if len(body) > 2 else b"") + b'"now":' + repr(time.time()).encode() + b"}"
