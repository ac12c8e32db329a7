"""Sending from a site: a planned transfer delivered with retries (exponential backoff and
jitter), to the receiver's address or, when it cannot be reached directly, through the relay
(``peer/relay_client.py``), never to a site whose certificate was revoked and never after a reroute
took the transfer off this site's part of the plan; then reported to the coordinator.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc

from fedrelay import purpose as purposes
from fedrelay.calls import CONTROL_TIMEOUT, backoff_delays, status_message
from fedrelay.tensors import schema_digest
from fedrelay.peer import relay_client
from fedrelay.peer.relay_client import RelayUnavailable
from fedrelay.peer.reporting import RETRYABLE
from fedrelay.peer.runs import Run, RunEnded, sent_key
from fedrelay.peer.site import Site
from fedrelay.peer.transfer import SendCancelled, Sent, send_model
from fedrelay.sealing import SealError
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb

log = logging.getLogger("fedrelay.peer")

REROUTE_GRACE = 120.0  # seconds a final-model copy retries a refusal after a reroute (see Sending.deliver)


class Sending:
    """Delivers one site's planned transfers."""

    def __init__(self, site: Site):
        self.site = site

    def deliver(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, sha: str, size: int) -> bool:
        """Send ``path`` for the planned transfer ``t`` with retries (exponential backoff and
        jitter), then report it to the coordinator.

        Direct first: the stream goes to the receiver's address. A receiver that only connects
        out (no address), or one not reached directly for ``relay_after`` seconds (0: never),
        gets the payload through the relay instead, sealed to its certificate key
        (``peer/relay_client.py``); the report then says ``route = "relayed"``.

        Returns False, having sent nothing, when a reroute took ``t`` off this site's part of the
        plan meanwhile; True once delivered (or delivered before)."""
        key = sent_key(t)
        if key in run.sent:
            return True
        header = common_pb2.TransferHeader(run_id=run.run_id, hop=t.index, sender=self.site.name, total_bytes=size,
                                           sha256=sha, purpose=t.purpose)
        to = run.peer(t.receiver)
        version = run.assignment.route_version
        started = time.monotonic()
        deadline = started + self.site.send_deadline
        counter, attempts = [0], 0  # bytes put on the wire by every attempt; streams begun
        relayed = not to.address
        for delay in backoff_delays():
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            if run.assignment.route_version != version and not self.still_planned(run, t):
                log.info("run %s: %s to %s is no longer in this site's plan; not sending it", run.run_id,
                         purposes.said(t.purpose), t.receiver)
                return False
            if self.revoked(to.name, run, t, deadline, delay):  # wait for the coordinator's reroute
                continue
            try:
                attempts += 1
                if relayed:
                    sent = self.send_relayed(run, t, path, counter)
                else:  # under TLS the receiver's certificate must name the site we mean to reach
                    sent = send_model(to.address, header, path, transport=self.site.transport, expect=to.name,
                                      counter=counter,
                                      cancelled=lambda: run.ended.is_set() or self.is_revoked(to.name))
                break
            except SendCancelled:  # the coordinator ended the run mid-stream, or revoked the receiver
                if run.ended.is_set():
                    raise RunEnded(run.run_id) from None
                log.warning("run %s: stopped sending %s %d to %s mid-stream: its certificate was revoked", run.run_id,
                            purposes.said(t.purpose), t.index, to.name)
            except (RelayUnavailable, SealError) as exc:
                raise RuntimeError(f"cannot send {purposes.said(t.purpose)} {t.index} to {to.name} through the "
                                   f"relay: {exc}") from exc
            except relay_client.NoCertificateYet as exc:  # the coordinator restarted: the receiver registers again soon
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot send to {to.name} through the relay: {exc}") from exc
                log.warning("run %s: %s; retrying in %.1f s", run.run_id, exc, delay)
                self.pause(run, delay)
                if self.site.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not relayed:
                    to = self.resolve(to)
                    waited = time.monotonic() - started
                    if not to.address or (self.site.relay_after and waited >= self.site.relay_after and self.site.transport.secure):
                        relayed = True
                        log.warning("run %s: %s not reached directly%s; sending through the relay at %s", run.run_id,
                                    to.name, f" for {waited:.0f} s" if to.address else " (it connects out only)",
                                    self.site.relay_address)
                # A receiver may not know yet that a reroute changed its plan (a final copy from a
                # new final site, a hop from a new sender): its refusal is retried for a while (the
                # route reaches it within seconds).
                rerouting = (exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
                             and run.assignment.route_version > 0 and time.monotonic() - started < REROUTE_GRACE)
                where = f"the relay at {self.site.relay_address}" if relayed else f"{to.name} at {to.address}"
                if (exc.code() not in RETRYABLE and not rerouting) or time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot deliver to {where}: {status_message(exc)}") from exc
                log.warning("run %s: delivery to %s failed (%s); retrying in %.1f s", run.run_id, where,
                            status_message(exc), delay)
                self.pause(run, delay)
                if self.site.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
                run.rerouted.clear()
        if run.run_status == "cancelled":  # stopped while the last chunks went out: report nothing more
            raise RunEnded(run.run_id)
        if sent.receipt.duplicate:  # a retry of a transfer that had arrived: acknowledged, no effect
            log.info("run %s: %s already held this model (sha256 %s)", run.run_id,
                     "the relay" if relayed else to.name, sha[:12])
        if sent.resumed_from:
            log.info("run %s: resumed the transfer to %s at byte %d of %d", run.run_id,
                     "the relay" if relayed else to.name, sent.resumed_from, sent.payload_bytes)
        self.site.report("ReportHop", cpb.HopReport(
            run_id=run.run_id, hop=t.index, purpose=t.purpose, sender=self.site.name, receiver=to.name,
            payload_bytes=size, wire_bytes=counter[0], sha256=sha, started=sent.started,
            ended=sent.ended, attempts=attempts, resumed_from=sent.resumed_from, round=t.round,
            schema_sha256=schema_digest(path), route=sent.route, sealed_bytes=sent.sealed_bytes,
            relay=sent.relay, sealed_sha256=sent.sealed_sha256))
        self.site.metrics.delivered(t.purpose, size, counter[0], attempts, sent.resumed_from)
        run.sent.append(key)
        run.save()
        if relayed:  # the relay holds the envelope now: this site needs its copy no more
            for envelope in run.path("sealed").glob(f"{purposes.BY_WIRE[t.purpose]}-{t.index}-{t.receiver}-*.sealed"):
                envelope.unlink(missing_ok=True)
        return True

    def send_relayed(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, counter: list[int]) -> Sent:
        """One attempt at sending ``path`` through the relay: sealed to the receiver's
        certificate (asked of the coordinator), then streamed to the relay from the bytes it
        holds. Raises ``grpc.RpcError``, ``RelayUnavailable`` or ``SealError``."""
        if self.site.coordinator is None:
            raise RelayUnavailable("no coordinator to ask for the receiver's certificate")
        ref = self.site.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=t.receiver), timeout=CONTROL_TIMEOUT)
        sealed, sealed_bytes, sealed_sha = relay_client.seal(self.site.transport, run.run_id, t, path, ref.certificate,
                                                         run.path("sealed"))
        relay = self.site.relay_address
        grant = None
        if self.site.coordinator.relay:  # the operator's relay carries only what the coordinator granted
            grant = self.site.coordinator.stub.GrantRelay(cpb.RelayGrantRequest(
                run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=t.receiver), timeout=CONTROL_TIMEOUT)
        sent = relay_client.put(relay, self.site.transport, run.run_id, t, sealed, counter, cancelled=run.ended.is_set,
                            grant=grant)
        sent.route, sent.relay, sent.sealed_bytes, sent.sealed_sha256 = "relayed", relay, sealed_bytes, sealed_sha
        return sent

    def pause(self, run: Run, seconds: float) -> None:
        """Wait up to ``seconds`` between delivery attempts; back early when the daemon stops,
        the run is rerouted or the coordinator ends it."""
        until = time.monotonic() + seconds
        while not (self.site.stop.is_set() or run.rerouted.is_set() or run.ended.is_set()):
            left = until - time.monotonic()
            if left <= 0:
                return
            self.site.stop.wait(min(left, 0.25))

    def resolve(self, to: common_pb2.SiteRef) -> common_pb2.SiteRef:
        """``to`` at the address its daemon last registered with the coordinator (it may have
        come back elsewhere); ``to`` itself when the coordinator cannot say. Under TLS the
        receiver's certificate must still name ``to.name``: a wrong address cannot impersonate."""
        if self.site.coordinator is None:
            return to
        try:
            now = self.site.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=to.name), timeout=CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            log.debug("could not resolve %s: %s", to.name, status_message(exc))
            return to
        if now.address and now.address != to.address:
            log.info("%s moved from %s to %s", to.name, to.address, now.address)
            return common_pb2.SiteRef(name=to.name, address=now.address)
        return to

    def is_revoked(self, name: str) -> bool:
        return self.site.revocations is not None and self.site.revocations.revoked_name(name) is not None

    def revoked(self, name: str, run: Run, t: common_pb2.PlannedTransfer, deadline: float, delay: float) -> bool:
        """True (after a pause) when ``name`` is revoked: nothing is sent to it; the coordinator
        routes the run around it, and the reroute ends the wait (``deliver`` finds ``t`` off
        the plan). Raises ``RuntimeError`` past ``deadline`` (monotonic seconds)."""
        if not self.is_revoked(name):
            return False
        if time.monotonic() + delay > deadline:
            raise RuntimeError(f"cannot deliver to {name}: its certificate was "
                               f"{self.site.revocations.revoked_name(name).describe()}")
        log.warning("run %s: not sending %s %d to %s: its certificate was revoked; waiting for the coordinator "
                    "to route around it", run.run_id, purposes.said(t.purpose), t.index, name)
        self.pause(run, delay)
        if self.site.stop.is_set():
            raise RuntimeError("daemon stopping")
        return True

    @staticmethod
    def still_planned(run: Run, t: common_pb2.PlannedTransfer) -> bool:
        return any(p == t for p in run.assignment.transfers)
