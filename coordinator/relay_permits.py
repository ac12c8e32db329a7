"""Which relayed transfers the coordinator allows, and with which bounds: the
:class:`~fedrelay.coordinator.relay_bounds.Permit` of a transfer of a running run's plan, for the
coordinator's own relay (asked on every Put) and for the grants it signs for an operator's
relay (``Coordinator.GrantRelay``).

The envelope's cap is the run's payload cap plus the sealing overhead
(``fedrelay.transfer_bounds.payload_cap`` / ``sealed_cap``), from what the coordinator knows:

- once the run's sizes are fixed (the first transfer both ends agreed on: ``model_bytes``,
  ``upload_bytes`` of the ledger), the cap of that size;
- before, the cap the receiver states (``Peer.RelayQuota``: the cap it enforces itself, from
  the run's payload schemas), asked once per (run, receiver) and kept in memory. A receiver
  that cannot be asked now makes the transfer wait (``relay_bounds.CapUnknown``: UNAVAILABLE, the sender
  retries).

The run's quota at a relay is what its plan can need: every planned transfer relayed, each at
the cap.
"""

from __future__ import annotations

import threading
from typing import Callable

import grpc

from fedrelay import purpose as purposes
from fedrelay import names, transfer_bounds
from fedrelay.calls import CONTROL_TIMEOUT, status_message
from fedrelay.coordinator import relay_bounds
from fedrelay.coordinator.relay_bounds import CapUnknown, Permit
from fedrelay.v1 import common_pb2, peer_pb2

MAX_STATED_CAP = 1 << 40  # bytes: a receiver's stated cap above this is not believed


class RelayPermits:
    """The coordinator's word on relayed transfers.

    ``ledger``: the coordinator's ``Ledger``; ``planned(run_id, purpose word, index, sender,
    receiver)``: the planned transfer or None (``RunPlans.planned``);
    ``plan(run_id)``: (version, ``Plan``) of the latest plan; ``peer(site dict)``: the Peer stub
    of a site (directly or over its control stream)."""

    def __init__(self, ledger, planned: Callable, plan: Callable, peer: Callable):
        self.ledger = ledger
        self.planned = planned
        self.plan = plan
        self.peer = peer
        self._caps: dict[tuple[str, str], int] = {}  # (run, receiver) -> payload cap it stated
        self._lock = threading.Lock()

    def permit(self, run_id: str, purpose: int, index: int, sender: str, receiver: str) -> Permit:
        """The permit of the transfer ``sender -> receiver`` (``purpose``, ``index``) of run
        ``run_id``. Raises ``PermissionError`` (the run is not running, or the transfer is in no
        version of its plan) or ``CapUnknown`` (its payload cap cannot be learnt now)."""
        try:
            names.check_run_id(run_id)
            names.check_site_name(sender, "sender")
            names.check_site_name(receiver, "receiver")
        except names.InvalidName as exc:
            raise PermissionError(str(exc)) from None
        run = self.ledger.run(run_id)
        if run is None or run["status"] != "running":
            raise PermissionError(f"run {run_id!r} is not running")
        word = purposes.ledger_of_wire(purpose)
        if word is None or self.planned(run_id, word, index, sender, receiver) is None:
            raise PermissionError(f"{sender} -> {receiver} is not transfer {index} of run {run_id}'s plan")
        return Permit.for_plan(self.payload_cap(run, word, receiver), len(self.plan(run_id)[1].transfers))

    def grant(self, signer, run_id: str, purpose: int, index: int, sender: str, receiver: str) -> common_pb2.RelayGrant:
        """The coordinator's grant, signed with ``signer``, for ``sender`` to send the transfer
        through the operator's relay (``relay_bounds.issue_grant``), within its :meth:`permit`.
        Raises ``PermissionError`` or ``CapUnknown``."""
        permit = self.permit(run_id, purpose, index, sender, receiver)
        return relay_bounds.issue_grant(signer, run_id, purpose, index, sender, receiver, permit)

    def payload_cap(self, run: dict, word: str, receiver: str) -> int:
        """The largest payload (bytes) of a ``word`` transfer of ``run`` into ``receiver``.
        Raises ``CapUnknown``."""
        size = run["upload_bytes"] if word == "upload" else run["model_bytes"]
        if size:
            return transfer_bounds.payload_cap(size)
        key = (run["run_id"], receiver)
        with self._lock:
            if key in self._caps:
                return self._caps[key]
        try:
            reply = self.peer({"name": receiver, "address": ""}).RelayQuota(
                peer_pb2.RelayQuotaRequest(run_id=run["run_id"]), timeout=CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            raise CapUnknown(f"the payload cap of run {run['run_id']} is not known yet ({receiver} did not say: "
                              f"{status_message(exc)}); retry") from None
        cap = int(reply.payload_cap_bytes)
        if not 0 < cap <= MAX_STATED_CAP:
            raise CapUnknown(f"{receiver} stated a payload cap of {cap} bytes for run {run['run_id']}; retry")
        with self._lock:
            self._caps[key] = cap
        return cap

    def runs(self) -> set[str]:
        """The runs something was learnt of."""
        with self._lock:
            return {k[0] for k in self._caps}

    def forget(self, run_id: str) -> None:
        """The run has ended: drop what was learnt of it."""
        with self._lock:
            for key in [k for k in self._caps if k[0] == run_id]:
                del self._caps[key]
