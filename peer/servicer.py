"""The Peer gRPC servicer: checks and translation only; the work is in ``PeerNode`` and the modules it delegates to.

Every refusal is a gRPC status with a one-line reason; an exception in one call never stops the
daemon from serving the next.

Authorization under mutual TLS (identity = the caller's certificate name): Assign, CheckPolicy, Evaluate,
FetchModel, Reroute, EndRun and RelayReady only from the ``coordinator`` identity (also when they
come over the control stream of a site that only connects out: ``peer/tunnel_client.py``); GetStatus from the coordinator or the
site's own identity (its administrator, with the site's own TLS folder); Handoff only from the run's
assigned predecessor or last site (checked in ``peer/receiving.py``), TransferOffset and Prepare likewise. Refusals are
PERMISSION_DENIED. A plaintext daemon has no identities (only the name checks apply).
"""

from __future__ import annotations

import logging

import grpc

from fedrelay import names
from fedrelay.callers import COORDINATOR_IDENTITY, caller_identity
from fedrelay.calls import POLICY_REFUSAL
from fedrelay.files import sha256_file
from fedrelay.peer.node import PeerNode
from fedrelay.peer.policy import PolicyRefusal
from fedrelay.peer.transfer import model_stream
from fedrelay.receiving import TransferError
from fedrelay.v1 import common_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("fedrelay.peer")


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, node: PeerNode):
        self.node = node

    @staticmethod
    def _from_coordinator(context) -> None:
        who = caller_identity(context)
        if who is not None and who != COORDINATOR_IDENTITY:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"only the coordinator may call this; the caller's certificate names {who!r}")

    def Assign(self, request: peer_pb2.Assignment, context) -> peer_pb2.AssignReply:
        names.check_assignment(request)
        self._from_coordinator(context)
        try:
            state = self.node.assign(request)
        except PolicyRefusal as exc:  # the site's own policy (peer/policy.py): the coordinator records it as such
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{POLICY_REFUSAL}{exc}")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"assignment refused: {exc}")
        return peer_pb2.AssignReply(run_id=request.run_id, state=state)

    def CheckPolicy(self, request: peer_pb2.Assignment, context) -> peer_pb2.PolicyVerdict:
        """Whether this site's policy accepts ``request`` (nothing is kept: ``peer/policy.py``)."""
        names.check_assignment(request)
        self._from_coordinator(context)
        if request.site != self.node.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"assignment is for {request.site!r}, this peer is {self.node.name!r}")
        try:
            held = self.node.policy.check(request)
        except PolicyRefusal as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{POLICY_REFUSAL}{exc}")
        return peer_pb2.PolicyVerdict(run_id=request.run_id, has_policy=held)

    def Handoff(self, request_iterator, context) -> peer_pb2.HandoffReceipt:
        try:
            return self.node.handoff(request_iterator, caller=caller_identity(context))
        except TransferError as exc:
            context.abort(exc.code, exc.message)
        except OSError as exc:  # e.g. a full disk: nothing was kept
            log.error("handoff failed: %s", exc)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot store the model: {exc}")

    def Prepare(self, request: peer_pb2.PrepareRequest, context) -> peer_pb2.PrepareReply:
        names.check_run_id(request.run_id)
        names.check_site_name(request.sender, "sender")
        try:
            started = self.node.prepare(request.run_id, request.sender, caller=caller_identity(context))
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return peer_pb2.PrepareReply(started=started)

    def TransferOffset(self, request: common_pb2.TransferHeader, context) -> peer_pb2.TransferOffsetReply:
        try:
            return self.node.transfer_offset(request, caller=caller_identity(context))
        except TransferError as exc:
            context.abort(exc.code, exc.message)

    def _from_coordinator_or_self(self, context) -> None:
        who = caller_identity(context)
        if who is not None and who not in (COORDINATOR_IDENTITY, self.node.name):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"only the coordinator or this site's own identity ({self.node.name!r}) may ask for its "
                          f"status; the caller's certificate names {who!r}")

    def GetStatus(self, request, context) -> peer_pb2.PeerStatus:
        self._from_coordinator_or_self(context)
        return self.node.status()

    def Evaluate(self, request: peer_pb2.EvaluateRequest, context) -> peer_pb2.EvaluateReply:
        names.check_run_request(request)
        self._from_coordinator(context)
        try:
            return self.node.evaluate(request.run_id, request.sha256)
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]))

    def Reroute(self, request: peer_pb2.RerouteRequest, context) -> peer_pb2.RerouteReply:
        names.check_reroute(request)
        self._from_coordinator(context)
        try:
            state = self.node.reroute(request)
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reroute refused: {exc}")
        return peer_pb2.RerouteReply(run_id=request.run_id, state=state)

    def EndRun(self, request: peer_pb2.EndRunRequest, context) -> peer_pb2.EndRunReply:
        names.check_end_run(request)
        self._from_coordinator(context)
        try:
            state, removed = self.node.end_run(request.run_id, request.status, request.reason, request.cancelled_by)
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        return peer_pb2.EndRunReply(run_id=request.run_id, state=state, removed_bytes=removed)

    def RelayQuota(self, request: peer_pb2.RelayQuotaRequest, context) -> peer_pb2.RelayQuotaReply:
        """The largest payload this site accepts in a run (the coordinator bounds the relay with it)."""
        names.check_run_id(request.run_id)
        self._from_coordinator(context)
        try:
            return peer_pb2.RelayQuotaReply(payload_cap_bytes=self.node.relay_quota(request.run_id))
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def RelayReady(self, request: peer_pb2.RelayNotice, context) -> peer_pb2.RelayReadyReply:
        names.check_run_id(request.run_id)
        names.check_site_name(request.sender, "sender")
        names.check_sha256(request.sealed_sha256, "sealed_sha256")
        if request.relay:
            names.check_address(request.relay, "relay")
        self._from_coordinator(context)
        try:
            return peer_pb2.RelayReadyReply(state=self.node.relay_ready(request))
        except TransferError as exc:
            context.abort(exc.code, exc.message)

    def FetchModel(self, request: peer_pb2.FetchModelRequest, context):
        names.check_run_request(request)
        self._from_coordinator(context)
        try:
            path = self.node.final_model_path(request.run_id, request.sha256)
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]))
        header = common_pb2.TransferHeader(run_id=request.run_id, sender=self.node.name,
                                           total_bytes=path.stat().st_size, sha256=sha256_file(path),
                                           purpose=common_pb2.FINAL_MODEL)
        yield from model_stream(header, path)
