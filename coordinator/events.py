"""The coordinator's in-memory event fan-out: every run's recent events, pushed to its watchers.

The ledger's ``events`` table is the record; reading it per watcher per event does not scale
(100 sites, a few watchers and a web page: one SQLite query per watcher per event). The
:class:`EventHub` is attached to the ledger (``Ledger.on_event``) and receives each event as
it is committed, under the ledger's lock, so the hub and the table never disagree. It keeps,
per run, a bounded tail of the most recent events (``tail`` events, with their ledger seq) and
the seq below which the tail is incomplete (its *floor*: events of the hub's lifetime that fell
off the tail, or the ledger's last seq when the hub was attached). A reader asking for the
events after ``seq``:

- gets them from memory when ``seq`` >= the run's floor (the common case: a watcher that has
  caught up);
- otherwise reads the ledger once (``Ledger.events_after``) for what is older than the tail,
  and takes the rest from memory.

Watchers subscribe with a callable (:meth:`EventHub.subscribe`) that the hub calls, cheaply and
under its lock, when an event of their run arrives or the run ends: a ``threading.Event.set``
(``WatchRun``) or an ``asyncio`` loop's ``call_soon_threadsafe`` (the web page's stream). No
thread polls, and only the watchers of the run that changed wake.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Any, Callable, Iterator

DEFAULT_TAIL = 4096  # events kept in memory per run (a 100-site chain writes ~15 per site)
KEEP_ENDED_TAILS = 16  # ended runs whose tails stay in memory (older ones are read from the ledger)


class _RunEvents:
    __slots__ = ("tail", "seqs", "floor", "ended", "watchers")

    def __init__(self, floor: int, tail: int):
        self.tail: deque[dict[str, Any]] = deque(maxlen=tail)
        self.seqs: deque[int] = deque(maxlen=tail)
        self.floor = floor          # every event of the run with seq > floor is in ``tail``
        self.ended = False          # the run has ended (Ledger.finish_run)
        self.watchers: dict[int, Callable[[], None]] = {}


class EventHub:
    """Recent events of every run, in memory, and their watchers (thread-safe).

    ``ledger``: the :class:`~fedrelay.coordinator.ledger.Ledger` whose events these are; the
    hub registers itself there (``on_event``, ``on_run_ended``). ``tail``: events kept per run.
    """

    def __init__(self, ledger, tail: int = DEFAULT_TAIL):
        self.ledger = ledger
        self.tail_size = tail
        self._lock = threading.Lock()
        self._runs: dict[str, _RunEvents] = {}
        self._ended_order: deque[str] = deque()
        self._next_token = 0
        self.ledger_reads = 0  # catch-up reads of the ledger (for tests and the bench)
        with ledger.lock:  # no event can be committed between reading the last seq and attaching
            self._start = ledger.last_event_seq()
            ledger.on_event.append(self._published)
            ledger.on_run_ended.append(self._ended)

    # -- fed by the ledger (under its lock) ---------------------------------------------------------
    def _run(self, run_id: str) -> _RunEvents:
        r = self._runs.get(run_id)
        if r is None:
            r = self._runs[run_id] = _RunEvents(self._start, self.tail_size)
        return r

    def _published(self, event: dict[str, Any]) -> None:
        """A committed event (a row of the ledger's ``events`` table, ``data`` as JSON text)."""
        with self._lock:
            r = self._run(event["run_id"])
            if len(r.tail) == r.tail.maxlen:
                r.floor = r.seqs[0]  # the oldest falls off: older ones are in the ledger only
            r.tail.append(event)
            r.seqs.append(event["seq"])
            watchers = list(r.watchers.values())
        for wake in watchers:
            wake()

    def _ended(self, run_id: str, status: str, error: str | None) -> None:
        with self._lock:
            r = self._run(run_id)
            r.ended = True
            watchers = list(r.watchers.values())
            self._ended_order.append(run_id)
            while len(self._ended_order) > KEEP_ENDED_TAILS:  # drop old tails, keep their floors right
                old = self._runs.get(self._ended_order.popleft())
                if old is not None and old.tail and not old.watchers:
                    old.floor = old.seqs[-1]
                    old.tail.clear()
                    old.seqs.clear()
        for wake in watchers:
            wake()

    # -- readers ------------------------------------------------------------------------------------
    def events_after(self, run_id: str, seq: int) -> list[dict[str, Any]]:
        """The run's events with ledger seq > ``seq``, oldest first (rows like
        ``Ledger.events_after``: seq, run_id, time, kind, site, message, data as JSON text).
        From memory when the tail reaches back to ``seq``, else one ledger read for the
        older part."""
        with self._lock:
            r = self._runs.get(run_id)
            floor = r.floor if r is not None else self._start
            if seq >= floor:
                if r is None:
                    return []
                i = bisect.bisect_right(r.seqs, seq)
                return [r.tail[k] for k in range(i, len(r.tail))]
        with self.ledger.lock:  # nothing is committed (or published) meanwhile: the ledger has it all
            self.ledger_reads += 1
            return self.ledger.events_after(run_id, seq)

    def ended(self, run_id: str) -> bool:
        """The run ended while this hub was attached (otherwise ask the ledger once)."""
        with self._lock:
            r = self._runs.get(run_id)
            return bool(r and r.ended)

    def subscribe(self, run_id: str, wake: Callable[[], None]) -> int:
        """Call ``wake()`` (cheap, non-blocking; from the thread that committed the event) when
        an event of ``run_id`` is committed or the run ends. Returns a token for
        :meth:`unsubscribe`."""
        with self._lock:
            self._next_token += 1
            self._run(run_id).watchers[self._next_token] = wake
            return self._next_token

    def unsubscribe(self, run_id: str, token: int) -> None:
        with self._lock:
            r = self._runs.get(run_id)
            if r is not None:
                r.watchers.pop(token, None)

    def watch(self, run_id: str, after_seq: int, ended: bool, is_active: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        """The run's events after ``after_seq`` as they come (rows as :meth:`events_after`), while
        ``is_active()``, until the run has ended (``ended``: it had when the watcher asked) and
        every event is out. Events come from memory once caught up (one ledger read at most, for
        what is older than the tail); the hub wakes this watcher when its run has news, and at
        least every second, to notice a watcher that went away."""
        news = threading.Event()
        token = self.subscribe(run_id, news.set)
        try:
            seq = after_seq
            while is_active():
                news.clear()
                events = self.events_after(run_id, seq)
                for e in events:
                    seq = e["seq"]
                    yield e
                if not events:
                    if ended or self.ended(run_id):
                        return
                    news.wait(1.0)
        finally:
            self.unsubscribe(run_id, token)

    def watchers(self, run_id: str) -> int:
        """How many watchers the run has now."""
        with self._lock:
            r = self._runs.get(run_id)
            return len(r.watchers) if r else 0

    def last_seq(self, run_id: str) -> int | None:
        """The ledger seq of the run's newest event this hub has seen (None: none since it
        attached, or the tail was dropped). Cheap: no ledger read; the page's data cache keys
        on it (``coordinator/web/cache.py``)."""
        with self._lock:
            r = self._runs.get(run_id)
            if r is None:
                return None
            return r.seqs[-1] if r.seqs else r.floor
