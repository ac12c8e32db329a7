"""The sites' reports at the coordinator: which are admitted (a running run, a site of it, not
routed around), the checks every transfer report gets, and what each records in the ledger: a
sender's transfer (``HopReport``), a receiver's receipt, progress (epochs and states), the final
model (then the evaluation starts) and a failure (the run fails). Both ends' reports of a
transfer are settled against each other and the run's model size and schema."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from fedrelay import purpose as purposes
from fedrelay.calls import CONTROL_TIMEOUT
from fedrelay.coordinator.ledger import LedgerConflict
from fedrelay.coordinator.lifecycle import fail
from fedrelay.coordinator.owed import Owed
from fedrelay.coordinator.plan import Transfer, star_plan
from fedrelay.coordinator.progress_limit import ProgressLimit
from fedrelay.coordinator.refusal import Refused
from fedrelay.coordinator.run_plans import RunPlans
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.coordinator")

WHAT = {"chain": "hop", "upload": "upload"}  # a transfer's name in events, by purpose (else the final model)


def _what(purpose: str, index: int, final: str) -> str:
    """``hop 3``, ``upload 2``, else ``final``."""
    return f"{WHAT[purpose]} {index}" if purpose in WHAT else final


class Reports:
    """The reports of the runs in ``ledger``. ``plans``: the ``RunPlans``; ``owed``: the shared
    ``Owed``; ``monitor``: the ``CoordinatorMonitor``; ``notices``: the ``Notices`` (relay
    notices owed for relayed transfers); ``tunnels``: the sites' control streams;
    ``address(name)``: a site's registered address; ``submit_evaluation(run_id)``: start the
    evaluation. ``progress_limit``: the progress reports' rate limit (``ProgressLimit``)."""

    def __init__(self, ledger, plans: RunPlans, owed: Owed, monitor, notices, tunnels, address: Callable,
                 submit_evaluation: Callable[[str], None]):
        self.ledger = ledger
        self.plans = plans
        self.owed = owed
        self.monitor = monitor
        self.notices = notices
        self.tunnels = tunnels
        self.address = address
        self.submit_evaluation = submit_evaluation
        self.progress_limit = ProgressLimit()

    # -- admission and checks ----------------------------------------------------------------------
    def admit(self, run_id: str, site: str, *, member: bool = True, ignored: str | None = None) -> dict | None:
        """The run a report of ``site`` is about, or None when nothing more is recorded for it
        (the run was stopped; or, with ``ignored``, ``site`` was routed around: an event says the
        report was ignored, with ``ignored`` as its message). Raises ``Refused`` (NOT_FOUND: unknown
        run; PERMISSION_DENIED: with ``member``, ``site`` is not a site of the run)."""
        run = self.ledger.run(run_id)
        if run is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r}")
        if member and site not in [s["name"] for s in run["chain"]]:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{site!r} is not a site of run {run['run_id']}")
        if run["status"] == "cancelled":
            return None  # the run was stopped: nothing more is recorded
        if ignored is not None and site in self.plans.skipped(run_id):  # a site routed around, back too late
            self.ledger.add_event(run_id, "state", ignored, site=site)
            return None
        return run

    @staticmethod
    def purpose_word(purpose: int) -> str:
        """The ledger's word for a wire purpose. Raises ``Refused`` (INVALID_ARGUMENT)."""
        word = purposes.ledger_of_wire(purpose)
        if word is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, purposes.WIRE_ERROR)
        return word

    def check(self, run: dict, purpose: str, index: int, sender: str, receiver: str, payload_bytes: int) -> Transfer:
        """The checks every transfer report gets: a planned transfer, of the run's model size (an
        upload: of the size of the run's uploads, model plus the aggregator's extra tensors).
        Raises ``Refused`` (PERMISSION_DENIED, INVALID_ARGUMENT)."""
        t = self.plans.planned(run["run_id"], purpose, index, sender, receiver)
        if t is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"{sender} -> {receiver} is not transfer {index} ({purpose}) of run {run['run_id']}'s plan")
        size, what = ((run["upload_bytes"], "uploads are") if purpose == "upload" else (run["model_bytes"], "model is"))
        if size and payload_bytes != size:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{payload_bytes} bytes reported; the run's {what} {size} bytes")
        return t

    def _transfer_report(self, request, site: str, ignored: str | None = None) -> tuple | None:
        """(run, purpose word, planned transfer) of a sender's or receiver's report, or None
        (nothing more is recorded). Raises ``Refused``."""
        run = self.admit(request.run_id, site, ignored=ignored)
        if run is None:
            return None
        purpose = self.purpose_word(request.purpose)
        t = self.check(run, purpose, request.hop, request.sender, request.receiver, request.payload_bytes)
        return run, purpose, t

    def settle(self, run: dict, purpose: str, index: int, receiver: str) -> None:
        """After either end reported: a transfer both ends agree on fixes the run's model size and
        schema (the first one) or must match them; a disagreement becomes a warning event."""
        row = self.ledger.transfer(run["run_id"], purpose, index, receiver)
        if row is None:
            return
        what = _what(purpose, index, f"final copy to {receiver}")
        if row["status"] == "done":
            got = row["receipt"]
            fresh = self.ledger.run(run["run_id"])
            size, schema = ("upload_bytes", "upload_schema_sha256") if purpose == "upload" else (
                "model_bytes", "schema_sha256")
            if not fresh[size]:
                self.ledger.update_run(run["run_id"], **{size: got["payload_bytes"], schema: got["schema_sha256"]})
            elif fresh[schema] and got["schema_sha256"] != fresh[schema]:
                self.ledger.add_event(run["run_id"], "warning", f"{what}: the payload's tensors differ from the "
                                      "run's model (schema digest)", site=receiver)
        elif row["status"] == "disputed":
            got = row["receipt"]
            self.ledger.add_event(
                run["run_id"], "warning",
                f"{what} disputed: {row['sender']} reported {row['payload_bytes']} bytes, sha256 "
                f"{(row['sha256'] or '')[:12]}; {receiver} attests {got['payload_bytes']} bytes, sha256 "
                f"{got['sha256'][:12]} from {got['sender']}", site=receiver)

    # -- a sender's transfer -----------------------------------------------------------------------
    def admit_hop(self, request: cpb.HopReport) -> tuple | None:
        """(run, purpose word, planned transfer) of a sender's report, or None: nothing more is
        recorded (a stopped run, a sender routed around). Raises ``Refused``."""
        return self._transfer_report(request, request.sender,
                                     ignored=f"ignored a hop report from {request.sender} (routed around)")

    def record_hop(self, request: cpb.HopReport, run: dict, purpose: str, t: Transfer, record=None) -> bool:
        """Record the sender's report, its event (the signed ``record`` bound to it) and what it
        settles, in one commit; False for a repeated report. Raises ``Refused`` (ALREADY_EXISTS:
        it contradicts an earlier report)."""
        try:
            with self.ledger.batch():  # the report, its event and what it settles: one commit
                new = self._record_hop(request, run, purpose, t, record)
        except LedgerConflict as exc:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        if new:
            self.monitor.transfer_reported(request, purpose)
        return new

    def _record_hop(self, request: cpb.HopReport, run: dict, purpose: str, t: Transfer, record=None) -> bool:
        new = self.ledger.record_hop(request.run_id, purpose, request.hop, request.sender, request.receiver,
                                     request.payload_bytes, request.wire_bytes, request.sha256,
                                     request.started, request.ended, request.attempts, request.resumed_from,
                                     round=t.round, schema_sha256=request.schema_sha256, route=request.route or "direct",
                                     sealed_bytes=request.sealed_bytes, sealed_sha256=request.sealed_sha256,
                                     relay=request.relay)
        if new:
            seconds = request.ended - request.started
            what = {"chain": f"hop {request.hop}" + (f" (round {t.round})" if run["rounds"] > 1 else ""),
                    "upload": f"upload {request.hop}"}.get(purpose, "final model")
            retried = (f", {request.attempts} attempts" if request.attempts > 1 else "") + (
                f", resumed at byte {request.resumed_from}" if request.resumed_from else "") + (
                f", through the relay ({request.sealed_bytes} sealed bytes)" if request.route == "relayed" else "")
            self.ledger.add_event(
                request.run_id, WHAT.get(purpose, "final_copy"),
                f"{what}: {request.sender} -> {request.receiver}, {request.payload_bytes} bytes, "
                f"sha256 {request.sha256[:12]}, {seconds:.2f} s{retried}",
                site=request.sender, hop=request.hop, round=t.round, sender=request.sender,
                receiver=request.receiver, payload_bytes=request.payload_bytes, wire_bytes=request.wire_bytes,
                sha256=request.sha256, seconds=seconds, attempts=max(1, request.attempts),
                resumed_from=request.resumed_from, route=request.route or "direct", record=record,
            )
            self.settle(run, purpose, request.hop, request.receiver)
            if request.route == "relayed" and self.ledger.transfer(request.run_id, purpose, request.hop,
                                                                    request.receiver)["receipt"] is None:
                self.notices.owe_relay_notice(request.run_id, request.purpose, request.hop, request.sender,
                                              request.receiver, request.relay, request.sealed_bytes,
                                              request.sealed_sha256)
                # at once, not at the monitor's next tick (the receiver waits for it)
                threading.Thread(target=self.notices.send_relay_notices, name="relay-notice", daemon=True).start()
        return new

    # -- a receiver's receipt ----------------------------------------------------------------------
    def admit_receipt(self, request: cpb.ReceiptReport) -> tuple | None:
        """(run, purpose word, planned transfer) of a receiver's report, or None (a stopped run).
        Raises ``Refused``."""
        return self._transfer_report(request, request.receiver)

    def record_receipt(self, request: cpb.ReceiptReport, run: dict, purpose: str, record=None) -> bool:
        """Record the receiver's side of a transfer (what it verified and kept), its event and
        what it settles, in one commit; its relay notice is no longer owed. False for a repeated
        report. Raises ``Refused`` (ALREADY_EXISTS)."""
        try:
            with self.ledger.batch():  # the receipt, its event and what it settles: one commit
                new = self.ledger.record_receipt(request.run_id, purpose, request.hop, request.sender,
                                                 request.receiver, request.payload_bytes, request.sha256,
                                                 request.schema_sha256, request.received,
                                                 route=request.route or "direct",
                                                 relay_wire_bytes=request.relay_wire_bytes)
                if new:
                    what = _what(purpose, request.hop, "final model")
                    self.ledger.add_event(
                        request.run_id, "receipt", f"{request.receiver} attests {what} from {request.sender}: "
                        f"{request.payload_bytes} bytes, sha256 {request.sha256[:12]}", site=request.receiver,
                        hop=request.hop, purpose=purpose, sender=request.sender, receiver=request.receiver,
                        payload_bytes=request.payload_bytes, sha256=request.sha256, record=record)
                    self.settle(run, purpose, request.hop, request.receiver)
        except LedgerConflict as exc:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        self.owed.receipt(request.run_id, purpose, request.hop, request.receiver)
        return new

    # -- progress ----------------------------------------------------------------------------------
    def progress(self, request: cpb.ProgressReport) -> bool:
        """Record a finished epoch (a metric and its event) or a state change; False when nothing
        was recorded (a stopped run, or over this member's rate: ``coordinator/progress_limit.py``).
        Raises ``Refused``."""
        run = self.admit(request.run_id, request.site)
        if run is None or not self.progress_limit.admit(request.run_id, request.site):
            return False
        if request.kind == "epoch":
            val = request.val_accuracy if request.val_accuracy >= 0 else None
            with self.ledger.batch():  # the metric and its event: one commit
                self._record_epoch(request, val)
            self.monitor.progress(request)
        else:
            self.ledger.add_event(request.run_id, "state",
                                  f"{request.site}: {request.state}"
                                  + (f" ({request.detail})" if request.detail else ""),
                                  site=request.site, state=request.state, detail=request.detail)
            if request.state == "training":
                try:
                    self.prepare_receiver(run, request.site)
                except Exception:  # noqa: BLE001 - a hint never fails the report it rides on
                    log.exception("run %s: could not pass on %s's prepare hint", request.run_id, request.site)
        return True

    def _record_epoch(self, request: cpb.ProgressReport, val: float | None) -> None:
        """A finished epoch's writes (inside a ledger batch)."""
        self.ledger.record_metric(request.run_id, request.site, request.stage, request.model,
                                  request.epoch, request.epochs, request.train_loss, val, request.seconds)
        what = request.stage if request.stage != "pool" else f"pool model {request.model}"
        val_s = f", val acc {val:.4f}" if val is not None else ""
        self.ledger.add_event(
            request.run_id, "epoch",
            f"{request.site}: {what}, epoch {request.epoch}/{request.epochs}, "
            f"loss {request.train_loss:.4f}{val_s}, {request.seconds:.1f} s",
            site=request.site, stage=request.stage, model=request.model, epoch=request.epoch,
            epochs=request.epochs, train_loss=request.train_loss, val_accuracy=val,
            seconds=request.seconds,
        )

    def prepare_receiver(self, run: dict, sender: str) -> None:
        """``sender`` started training: when the receiver of its next chain hop connects out
        only, tell it to start its worker (``Peer.Prepare`` over its control stream, on the
        sender's behalf: the sender cannot reach it, ``peer/node.py`` ``_tell_receiver``), once
        per hop, in the background. A hint: a failure is logged at debug level."""
        run_id = run["run_id"]
        if not self.tunnels.any_open():
            return  # no site connects out only: every sender reaches its receiver (no ledger read)
        if not self.ledger.plans(run_id):
            return  # no plan recorded (a run made by hand in a test)
        received = {h["hop"] for h in self.ledger.hops(run_id) if h["receipt"]}
        hops = [t for t in self.plans.current(run_id)[1].hops if t.sender == sender and t.index not in received]
        if not hops:
            return
        t = min(hops, key=lambda t: t.index)
        if self.address(t.receiver) or self.tunnels.get(t.receiver) is None:
            return  # the sender reaches it directly (or the receiver is not connected now)
        with self.owed.lock:
            if (run_id, t.index) in self.owed.prepared:
                return
            self.owed.prepared.add((run_id, t.index))

        def tell() -> None:
            try:
                self.tunnels.stub(t.receiver).Prepare(peer_pb2.PrepareRequest(run_id=run_id, sender=sender),
                                                      timeout=CONTROL_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - a hint
                log.debug("run %s: could not tell %s to prepare: %s", run_id, t.receiver, exc)

        threading.Thread(target=tell, daemon=True, name=f"prepare-{t.receiver}").start()

    # -- the final model ---------------------------------------------------------------------------
    def admit_final(self, request: cpb.FinalReport) -> dict | None:
        """The run of the final site's report, or None (a stopped run, or the same final model
        again). Raises ``Refused`` (PERMISSION_DENIED: not the plan's final site; ALREADY_EXISTS:
        another final model; INVALID_ARGUMENT: it differs from the copies the site sent)."""
        run = self.admit(request.run_id, request.site, member=False)
        if run is None:
            return None
        last = self.plans.current(request.run_id)[1].final_site
        if request.site != last:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"only the final site ({last}) reports the final model")
        if run["final_sha256"]:
            if run["final_sha256"] == request.sha256:
                return None
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"the final model was already reported with sha256 "
                                                          f"{run['final_sha256']}")
        copies = {h["sha256"] for h in self.ledger.hops(request.run_id, "final") if h["sender"] == request.site}
        if copies - {request.sha256, None}:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the final model's sha256 differs from the copies "
                                                            f"{request.site} reported sending")
        return run

    def record_final(self, request: cpb.FinalReport, run: dict, record=None) -> None:
        """Record the final model (and the sites whose uploads it lacks), then start the
        evaluation. Raises ``Refused`` (INVALID_ARGUMENT: ``missing`` names sites that upload to
        no aggregator)."""
        if request.missing:
            self._record_missing(run, list(request.missing))
        with self.ledger.batch():  # the final model, its event and its signed report: one commit
            self.ledger.update_run(request.run_id, final_sha256=request.sha256, final_site=request.site,
                                   model_bytes=run["model_bytes"] or request.model_bytes)
            self.ledger.add_event(request.run_id, "final",
                                  f"final model from {request.site}: sha256 {request.sha256}, "
                                  f"{request.model_bytes} bytes", site=request.site,
                                  sha256=request.sha256, model_bytes=request.model_bytes, record=record)
        self.submit_evaluation(request.run_id)

    def _record_missing(self, run: dict, missing: list[str]) -> None:
        """A star plan's aggregator combined the uploads without those of ``missing`` (they had
        not arrived within its upload timeout): they are routed around (no final copy, no
        evaluation), with a plan version that says so."""
        version, plan = self.plans.current(run["run_id"])
        order = [c["name"] for c in run["chain"]]
        if not plan.aggregator or any(m not in order or m == plan.aggregator for m in missing):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "missing uploads name sites that upload to no aggregator "
                                                            f"in run {run['run_id']}")
        skipped = self.plans.skipped(run["run_id"])
        received = {h["sender"] for h in self.ledger.hops(run["run_id"], "upload")}
        new = star_plan(order, plan.aggregator, skipped | set(missing), received - set(missing))
        reason = "its upload had not arrived when the aggregator combined the others (upload timeout)"
        if self.ledger.reroute(run["run_id"], new.to_json(), [(m, reason) for m in sorted(missing)]) is not None:
            self.ledger.add_event(run["run_id"], "warning", f"the aggregator combined the uploads without "
                                  f"{', '.join(sorted(missing))} (upload timeout): no final copy, no evaluation there",
                                  site=plan.aggregator, missing=sorted(missing))

    # -- a failure ---------------------------------------------------------------------------------
    def admit_failure(self, request: cpb.FailureReport) -> dict | None:
        """The run a site's failure ends, or None (a stopped run; a site routed around).
        Raises ``Refused``."""
        return self.admit(request.run_id, request.site, ignored=f"ignored a failure of {request.site} "
                                                                f"(routed around): {request.error}")

    def record_failure(self, request: cpb.FailureReport, record=None) -> None:
        """The run fails with the site's error (``record``: its signed report)."""
        fail(self.ledger, request.run_id, f"{request.site}: {request.error}", site=request.site, record=record)
