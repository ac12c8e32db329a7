"""Serving a daemon's Prometheus metrics over HTTP (``serve --metrics-listen HOST:PORT``).

Each daemon keeps its metrics in a registry of its own (``coordinator/monitoring.py``,
``peer/monitoring.py``), never in ``prometheus_client``'s global one, so that several daemons
in one process (the tests) do not collide. The endpoint is plain HTTP, read-only, with no
authentication: it carries counts, sizes, site names and run ids, never a model or data; bind it
to an address only your monitoring system reaches (e.g. ``127.0.0.1:9470``).
"""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from fedrelay import wire
from fedrelay.v1 import common_pb2

log = logging.getLogger("fedrelay.metrics")

# The ``purpose`` label of transfer metrics: the ledger's names, on both daemons.
PURPOSES = {common_pb2.CHAIN_HOP: "chain", common_pb2.UPLOAD: "upload", common_pb2.FINAL_MODEL: "final"}


def code_label(code: grpc.StatusCode) -> str:
    """The ``code`` label of a refusal: ``PERMISSION_DENIED`` -> ``permission_denied``."""
    return code.name.lower()


class MetricsServer:
    """A running metrics endpoint: ``address`` (``HOST:PORT``, the port bound), ``close()``."""

    def __init__(self, listen: str, registry: CollectorRegistry):
        try:
            host, port = wire.split_hostport(listen)
        except ValueError as exc:
            raise ValueError(f"--metrics-listen: {exc}") from None
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise RuntimeError(f"--metrics-listen {listen}: cannot listen ({exc.strerror or exc})") from exc
        self.address = wire.with_port(listen, self._server.server_port)
        log.info("metrics at http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
