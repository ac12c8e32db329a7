"""A run's evaluation at the coordinator: after the final model is reported, asking each live
site to evaluate it on its own test split (:class:`Evaluator`, in the background), checking what
each site reports, and combining the sites' aggregate statistics into the federation's figures
(``fedrelay.scoring``). No sample, score or prediction reaches the coordinator: counts only.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc

from fedrelay import checks, privacy, scoring
from fedrelay.calls import EVALUATE_TIMEOUT, backoff_delays, status_message
from fedrelay.signing import SignatureError
from fedrelay.v1 import peer_pb2

__all__ = ["Evaluator", "site_stats", "pooled", "metrics_line"]

log = logging.getLogger("fedrelay.coordinator")

EVAL_RETRY = 300.0  # seconds an evaluation waits for an unreachable site

MAX_METRICS = 64         # metrics one site may report
MAX_METRIC_NAME = 64     # characters of a metric's name
MAX_STATS_BYTES = 4 << 20


def site_stats(reply, num_classes: int) -> scoring.Stats:
    """The checked statistics of one site's ``EvaluateReply``; its metrics checked too (names
    of at most 64 printable characters, at most 64 of them, finite values, the built-in ones in
    [0, 1]). Raises ``ValueError`` naming the problem."""
    if len(reply.metrics) > MAX_METRICS:
        raise ValueError(f"{len(reply.metrics)} metrics (at most {MAX_METRICS})")
    for name, value in reply.metrics.items():
        if not name or len(name) > MAX_METRIC_NAME or not name.isprintable():
            raise ValueError(f"metric name {name[:MAX_METRIC_NAME]!r} is not 1 to {MAX_METRIC_NAME} printable characters")
        if not math.isfinite(value) or (name in scoring.BUILTIN and not 0.0 <= value <= 1.0):
            raise ValueError(f"metric {name!r} is {value}")
    if reply.correct > reply.test_samples:
        raise ValueError(f"{reply.correct} correct of {reply.test_samples} test samples")
    if len(reply.stats_json) > MAX_STATS_BYTES:
        raise ValueError(f"statistics of {len(reply.stats_json)} bytes (at most {MAX_STATS_BYTES})")
    try:
        raw = json.loads(reply.stats_json or "{}")
    except ValueError as exc:
        raise ValueError(f"statistics are not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("statistics must be a JSON object")
    try:
        privacy.spent_from_stats(raw)  # a DP run's spent (epsilon, delta), when the site reports one
    except ValueError as exc:
        raise ValueError(f"its differential-privacy record does not check: {exc}") from None
    raw = {k: v for k, v in raw.items() if k != "privacy"}
    if not raw:  # a site that reports no statistics (no test split, or an older daemon)
        return scoring.Stats(confusion=[[0] * num_classes for _ in range(num_classes)],
                             positive=1 if num_classes == 2 else -1)
    stats = scoring.Stats.from_dict(raw, num_classes)
    if sum(map(sum, stats.confusion)) != reply.test_samples:
        raise ValueError(f"its confusion matrix counts {sum(map(sum, stats.confusion))} samples, not its "
                         f"{reply.test_samples} test samples")
    return stats


def pooled(results: Iterable[tuple]) -> dict[str, float]:
    """The run's global metrics from ``(EvaluateReply, Stats)`` pairs: the built-in ones from
    the summed statistics, a task's own as the test-sample-weighted mean
    (:func:`fedrelay.scoring.global_metrics`). Raises ``ValueError``."""
    results = [(r, s) for r, s in results if r.test_samples]
    return scoring.global_metrics([s for _, s in results], [(dict(r.metrics), r.test_samples) for r, _ in results])


def metrics_line(metrics: Mapping[str, float]) -> str:
    """``"; balanced accuracy 0.81, macro-F1 0.80, AUROC 0.97 ..."`` for a log or event line (""
    when there is nothing besides accuracy)."""
    words = {"balanced_accuracy": "balanced accuracy", "macro_f1": "macro-F1", "auroc": "AUROC"}
    shown = [f"{words.get(k, k)} {v:.4f}" for k, v in metrics.items() if k != "accuracy"]
    return ("; " + ", ".join(shown)) if shown else ""


class Evaluator:
    """The end-of-run evaluation of the runs in ``ledger``. ``signatures``: the coordinator's
    ``Signatures`` (each site's reply is verified and kept signed); ``stub(site dict)``: a site's
    Peer stub; ``live_order(run)``: the run's sites not routed around; ``fail(run_id, error)``:
    fail the run; ``receipts``: the condition notified by every receipt (``Owed.receipts``).

    ``call_peer(site, method, request, timeout=...)`` makes each call to a site (by default
    :meth:`call_with_retry`; a test may put its own in its place); ``eval_retry``: seconds an
    evaluation waits for an unreachable site or a relayed copy."""

    def __init__(self, ledger, signatures, stub: Callable, live_order: Callable, fail: Callable, receipts):
        self.ledger = ledger
        self.signatures = signatures
        self.stub = stub
        self.live_order = live_order
        self.fail = fail
        self.receipts = receipts
        self.eval_retry = EVAL_RETRY
        self.call_peer = self.call_with_retry
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="evaluate")

    def call_with_retry(self, site: dict, method: str, request, *, timeout: float):
        """One call to a site's peer daemon, retried with backoff while the site is unreachable
        (a restarting daemon, a dropped link) for up to ``eval_retry`` seconds, with the
        daemons' one retry policy (``calls.backoff_delays``). Raises ``grpc.RpcError``."""
        deadline = time.monotonic() + self.eval_retry
        for delay in backoff_delays():
            try:
                return getattr(self.stub(site), method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s unreachable for %s (%s); retrying", site["name"], method, status_message(exc))
                time.sleep(delay)

    def submit(self, run_id: str, evaluate: Callable[[str], None] | None = None) -> None:
        """Evaluate the run's final model in the background (``evaluate``: the evaluation to run,
        by default :meth:`evaluate_run`). An unexpected error there is logged and fails the run
        with its reason (it used to vanish with the dropped future, leaving the run 'running'
        for ever)."""
        def done(future) -> None:
            exc = future.exception()
            if exc is not None:
                log.error("evaluation of run %s failed", run_id, exc_info=exc)
                self.fail(run_id, f"evaluation failed at the coordinator: {type(exc).__name__}: {exc}")

        self.pool.submit(evaluate or self.evaluate_run, run_id).add_done_callback(done)

    def wait_relayed_copy(self, run_id: str, site: str) -> None:
        """A final copy that went through the relay is kept at its site only once the site fetched
        and opened it: wait for its receipt (up to ``eval_retry`` seconds) before asking the site
        to evaluate. Direct copies were kept before they were reported."""
        deadline = time.monotonic() + self.eval_retry
        with self.receipts:
            while True:
                row = self.ledger.transfer(run_id, "final", 0, site)
                if row is None or row["route"] != "relayed" or row["receipt"] is not None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return  # Evaluate says why the site cannot
                self.receipts.wait(min(left, 5.0))

    def evaluate_run(self, run_id: str) -> None:
        """Ask every live site of the run to evaluate its final model (``Peer.Evaluate``, four at
        once), record each checked and signed reply, and finish the run with the pooled figures;
        a site that cannot evaluate, or a reply that does not check, fails the run."""
        run = self.ledger.run(run_id)
        sha = run["final_sha256"]
        results, errors = {}, []

        def one(site: dict) -> None:
            try:
                self.wait_relayed_copy(run_id, site["name"])
                reply = self.call_peer(site, "Evaluate", peer_pb2.EvaluateRequest(run_id=run_id, sha256=sha),
                                       timeout=EVALUATE_TIMEOUT)
                checks.check_evaluation(reply, site["name"])  # counts, accuracy, seconds (InvalidName)
                record = self.signatures.evaluation(reply, site["name"], run_id, sha)
                stats = site_stats(reply, len(run["class_index"]))
                results[site["name"]] = (reply, stats)
                with self.ledger.batch():  # the figures, their event and the signed reply: one commit
                    self.ledger.record_evaluation(run_id, site["name"], sha, reply.correct, reply.test_samples,
                                                  reply.accuracy, reply.seconds, dict(reply.metrics),
                                                  json.loads(reply.stats_json or "{}"))  # as the site signed them
                    self.ledger.add_event(run_id, "evaluated",
                                          f"{site['name']}: accuracy {reply.accuracy:.4f} on {reply.test_samples} "
                                          f"test samples{metrics_line(reply.metrics)}",
                                          site=site["name"], accuracy=reply.accuracy,
                                          test_samples=reply.test_samples, metrics=dict(reply.metrics),
                                          record=record)
            except grpc.RpcError as exc:
                errors.append(f"{site['name']}: {status_message(exc)}")
            except SignatureError as exc:
                errors.append(f"{site['name']}: its evaluation was refused: {exc}")
            except ValueError as exc:
                errors.append(f"{site['name']}: its evaluation does not check: {exc}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, self.live_order(run)))
        if errors:
            self.fail(run_id, "evaluation failed at " + "; ".join(errors))
            return
        correct = sum(r.correct for r, _ in results.values())
        total = sum(r.test_samples for r, _ in results.values())
        accuracy = correct / total if total else 0.0
        try:
            metrics = pooled(results.values())
        except ValueError as exc:
            self.fail(run_id, f"the sites' evaluations do not combine: {exc}")
            return
        self.ledger.finish_run(run_id, "finished", accuracy=accuracy, metrics=metrics,
                               message=f"run finished: global accuracy {accuracy:.4f} on {total} test samples"
                                       f"{metrics_line(metrics)}",
                               test_samples=total)
