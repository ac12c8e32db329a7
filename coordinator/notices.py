"""What the coordinator tells the sites after the fact, until they take it: the end of a run
(``Peer.EndRun``) and an envelope waiting at the relay (``Peer.RelayReady``); and the clearing
of what the relay and the permits hold for runs that have ended."""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from fedrelay import names, text
from fedrelay.calls import status_message
from fedrelay import purpose as purposes
from fedrelay.coordinator.ledger import TERMINAL
from fedrelay.coordinator.owed import Owed
from fedrelay.v1 import peer_pb2

log = logging.getLogger("fedrelay.coordinator")

END_NOTICE_RETRY = 10.0  # seconds before an end notice a live site did not take is sent again
RELAY_NOTICE_RETRY = 30.0  # seconds before a relay notice is sent again while the receipt has not come


class Notices:
    """End and relay notices of the runs in ``ledger``. ``owed``: the shared ``Owed``;
    ``stub(site dict)``: a site's Peer stub; ``dead(names)``: the sites to route around;
    ``skipped(run_id)``: the sites routed around; ``relay_address``: the operator's relay
    (HOST:PORT) or "" (this coordinator's); ``relay_permits``: the ``RelayPermits``;
    ``relay``: this coordinator's ``RelayService`` or None."""

    def __init__(self, ledger, owed: Owed, stub: Callable, dead: Callable, skipped: Callable, *,
                 relay_address: str = "", relay_permits=None, relay=None):
        self.ledger = ledger
        self.owed = owed
        self.stub = stub
        self.dead = dead
        self.skipped = skipped
        self.relay_address = relay_address
        self.relay_permits = relay_permits
        self.relay = relay

    # -- relay notices -----------------------------------------------------------------------------
    def owe_relay_notice(self, run_id: str, purpose: int, index: int, sender: str, receiver: str,
                         relay: str, sealed_bytes: int, sealed_sha256: str) -> None:
        """The receiver of a relayed transfer (``purpose``: the wire value) is owed a notice."""
        # "" (this coordinator's relay): the receiver fetches from the coordinator as it dials it
        notice = peer_pb2.RelayNotice(run_id=run_id, purpose=purpose, index=index, sender=sender,
                                      relay=self.relay_address, sealed_bytes=sealed_bytes, sealed_sha256=sealed_sha256)
        with self.owed.lock:
            self.owed.relay_notices[(run_id, purposes.ledger_of_wire(purpose), index, receiver)] = [notice, 0.0]

    def send_relay_notices(self) -> None:
        """Tell the receivers of relayed transfers that their envelope waits (``Peer.RelayReady``),
        over their control stream or directly; again every ``RELAY_NOTICE_RETRY`` seconds (and at
        once when a control stream reopens) until the receiver attests the transfer."""
        now = time.monotonic()
        with self.owed.lock:
            due = [(k, e[0]) for k, e in self.owed.relay_notices.items() if e[1] <= now]
            for k, _ in due:
                self.owed.relay_notices[k][1] = now + RELAY_NOTICE_RETRY
        for (run_id, purpose, index, receiver), notice in due:
            run = self.ledger.run(run_id)
            if run is None or run["status"] != "running":
                with self.owed.lock:
                    self.owed.relay_notices.pop((run_id, purpose, index, receiver), None)
                continue
            try:
                reply = self.stub({"name": receiver, "address": ""}).RelayReady(notice, timeout=5.0)
                log.info("run %s: told %s that %s %d waits at the relay (%s)", run_id, receiver, purpose, index,
                         reply.state)
            except grpc.RpcError as exc:
                log.info("run %s: relay notice not delivered to %s yet: %s", run_id, receiver, status_message(exc))

    def drop_ended_relayed(self) -> None:
        """Remove the envelopes the coordinator's relay holds for runs that have ended (and
        forget which of their hops' receivers were told to prepare)."""
        with self.owed.lock:
            ended = {k for k in self.owed.prepared if self._ended(k[0])}
            self.owed.prepared -= ended
        for run_id in self.relay_permits.runs():
            if self._ended(run_id):
                self.relay_permits.forget(run_id)
        if self.relay is None:
            return
        self.relay.sweep()  # what was never fetched expires
        for run_id in self.relay.runs():
            if self._ended(run_id):
                removed = self.relay.drop_run(run_id)
                if removed:
                    log.info("relay: removed %d bytes of run %s (ended)", removed, run_id)

    def _ended(self, run_id: str) -> bool:
        run = self.ledger.run(run_id)
        return run is None or run["status"] in TERMINAL

    # -- end notices -------------------------------------------------------------------------------
    def send_end_notices(self) -> None:
        """Tell every site of an ended run that it is over (``Peer.EndRun``), so that a site
        routed around stops waiting for a model, a site of a failed run stops training or
        sending, and partial transfers are removed. Owed notices live in the ledger: a site
        that is down gets its notice once it heartbeats again (also after a coordinator
        restart); a site that failed to answer is tried again after ``END_NOTICE_RETRY`` s."""
        pending = self.ledger.pending_end_notices()
        if not pending:
            return
        dead = self.dead(sorted({n["site"] for n in pending}))
        now = time.monotonic()
        for n in pending:
            key = (n["run_id"], n["site"])
            if n["site"] in dead or self.owed.end_retry.get(key, 0) > now:
                continue
            skipped = n["site"] in self.skipped(n["run_id"])
            reason = "this site was routed around" if skipped else (n["error"] or n["cancel_reason"] or "")
            # The error may quote sites' words (any length, any character): what EndRun takes.
            reason = text.clean(reason)[:names.MAX_TEXT]
            try:  # a live site has registered: stub dials its registered address
                reply = self.stub({"name": n["site"], "address": ""}).EndRun(
                    peer_pb2.EndRunRequest(run_id=n["run_id"], status=n["status"], reason=reason,
                                           cancelled_by=n["cancelled_by"] or ""), timeout=5.0)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the site never had the run
                    log.info("end of run %s not delivered to %s yet: %s", n["run_id"], n["site"],
                             status_message(exc))
                    self.owed.end_retry[key] = now + END_NOTICE_RETRY
                    continue
                reply = None
            self.ledger.end_notice_delivered(*key)
            self.owed.end_retry.pop(key, None)
            if reply is not None and (reply.state == "ended" or reply.removed_bytes) and n["status"] != "cancelled":
                self.ledger.add_event(n["run_id"], "state", f"{n['site']}: told the run is over; its state "
                                      f"{reply.state}, {reply.removed_bytes} bytes of partial transfers removed",
                                      site=n["site"])
