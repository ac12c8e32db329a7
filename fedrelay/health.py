"""The standard gRPC health service (``grpc.health.v1.Health``) on both daemons, and its probe.

Each daemon serves :class:`Health` on its gRPC port: ``SERVING`` for the overall health ("")
and for its own service (``fedrelay.v1.Coordinator`` or ``fedrelay.v1.Peer``) while it is up,
``NOT_SERVING`` from the moment it starts shutting down (watchers get the change). The health
service sits behind the same mutual TLS as every other call: a probe presents a certificate of
the federation (the site's own identity for its daemon, the coordinator's or operator's for the
coordinator). :func:`probe` is what ``peer health`` and ``coordinator health`` call.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedrelay.calls import status_message
from fedrelay.transport import Transport

COORDINATOR_SERVICE = "fedrelay.v1.Coordinator"
PEER_SERVICE = "fedrelay.v1.Peer"
SERVING = health_pb2.HealthCheckResponse.SERVING


class Health:
    """The health service of one gRPC ``server`` (added at construction, before the server
    starts): ``NOT_SERVING`` for "" and ``service`` until :meth:`serving`, again from
    :meth:`stopping` on (for good)."""

    def __init__(self, server: grpc.Server, service: str):
        # Blocking Watch: the daemons' guard (fedrelay.guard) wraps every handler and bounds
        # the calls in flight, a Watch included.
        self.servicer = health.HealthServicer(experimental_non_blocking=False)
        self.services = ("", service)
        for name in self.services:
            self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def serving(self) -> None:
        for name in self.services:
            self.servicer.set(name, SERVING)

    def stopping(self) -> None:
        """Every service NOT_SERVING, for the rest of the server's life."""
        self.servicer.enter_graceful_shutdown()


@dataclass(frozen=True)
class ProbeResult:
    """A health probe's outcome: ``status`` is the daemon's answer (``SERVING``, ``NOT_SERVING``,
    ``UNKNOWN``, ``SERVICE_UNKNOWN``), or ``UNREACHABLE`` (no connection: UNAVAILABLE)
    or ``ERROR`` (the call failed otherwise; ``grpc_code`` names its gRPC status, e.g.
    ``PERMISSION_DENIED``); ``line`` is the one-line description :func:`probe` returns."""

    status: str
    line: str
    grpc_code: str = ""

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"


def probe_result(transport: Transport, address: str, *, service: str = "", expect: str | None = None,
                 timeout: float = 5.0) -> ProbeResult:
    """:func:`probe`, with the outcome's kind kept apart (:class:`ProbeResult`). Never raises
    for a failed call."""
    with transport.channel(address, expect=expect) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            what = "UNREACHABLE" if code == grpc.StatusCode.UNAVAILABLE else "ERROR"
            return ProbeResult(what, f"{what} ({status_message(exc)})", getattr(code, "name", str(code)))
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ProbeResult(name, name)


def probe(transport: Transport, address: str, *, service: str = "", expect: str | None = None,
          timeout: float = 5.0) -> tuple[bool, str]:
    """Ask the daemon at ``address`` (``HOST:PORT``) for the health of ``service`` ("" = the
    daemon as a whole). Under TLS the daemon's certificate must name ``expect`` (an identity)
    when given, else the host in ``address``.

    Returns (True only when it answers SERVING, a one-line description: the status name, or
    ``UNREACHABLE`` / the gRPC status of a failed call). Never raises for a failed call."""
    r = probe_result(transport, address, service=service, expect=expect, timeout=timeout)
    return r.serving, r.line
