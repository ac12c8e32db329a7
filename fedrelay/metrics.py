"""Serving a daemon's Prometheus metrics over HTTP (``serve --metrics-listen HOST:PORT``).

Each daemon keeps its metrics in a registry of its own (``coordinator/monitoring.py``,
``peer/monitoring.py``), never in ``prometheus_client``'s global one, so that several daemons
in one process (the tests) do not collide. The endpoint is plain HTTP, read-only, with no
authentication: it carries counts, sizes, site names and run ids, never a model or data; bind it
to an address only your monitoring system reaches (e.g. ``127.0.0.1:9470``).

The endpoint has its own bounds (:class:`MetricsServer`): requests are served by a pool of
``workers`` threads (prometheus_client's own server starts a thread per connection: the hostile
trial's idle connections took 131 threads to 431), at most ``queued`` more connections wait for
one, and a connection over that is closed at once; a request must arrive within ``timeout``
seconds. Nothing is logged per connection (no traceback for a client that went away).

:class:`DaemonMetrics` is what both daemons' metrics share: the registry, the refused calls and
the endpoint.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

from fedrelay import purpose as purposes
from fedrelay.addresses import split_hostport, with_port

log = logging.getLogger("fedrelay.metrics")

# The ``purpose`` label of transfer metrics: the ledger's names, on both daemons.
PURPOSES = {purposes.wire_of_ledger(w): w for w in purposes.LEDGER_WORDS}


def code_label(code: grpc.StatusCode) -> str:
    """The ``code`` label of a refusal: ``PERMISSION_DENIED`` -> ``permission_denied``."""
    return code.name.lower()


WORKERS = 4      # threads serving scrapes
QUEUED = 16      # connections waiting for a thread; more are closed at once
TIMEOUT = 10.0   # seconds a connection may take to send its request (and to read the answer)


class _QuietHandler(WSGIRequestHandler):
    """A request handler that logs nothing (wsgiref would print each request, and a traceback
    for each client that went away, to stderr)."""

    timeout = TIMEOUT  # socket timeout, set per connection by StreamRequestHandler.setup

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def get_stderr(self):
        return io.StringIO()


class _BoundedServer(WSGIServer):
    """A WSGI server whose connections are served by a pool of ``workers`` threads, at most
    ``queued`` more waiting; a connection over that is closed unread (``refused`` counts them)."""

    def __init__(self, address, family: int, workers: int, queued: int, timeout: float):
        self.address_family = family
        handler = type("Handler", (_QuietHandler,), {"timeout": timeout})
        super().__init__(address, handler)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metrics")
        self._room = workers + queued
        self._lock = threading.Lock()
        self.pending = 0
        self.refused = 0

    def process_request(self, request, client_address):
        with self._lock:
            if self.pending >= self._room:
                self.refused += 1
                refuse = True
            else:
                self.pending += 1
                refuse = False
        if refuse:
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client's error (timeout, reset) ends its connection only
            log.debug("metrics request from %s ended early", client_address, exc_info=True)
        finally:
            self.shutdown_request(request)
            with self._lock:
                self.pending -= 1

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class MetricsServer:
    """A running metrics endpoint: ``address`` (``HOST:PORT``, the port bound), ``close()``.

    ``workers``: threads serving requests; ``queued``: connections that may wait for one (more
    are closed at once); ``timeout``: seconds a connection may take to send its request.
    Raises ``ValueError`` for a malformed ``listen``, ``RuntimeError`` when it cannot bind."""

    def __init__(self, listen: str, registry: CollectorRegistry, *, workers: int = WORKERS, queued: int = QUEUED,
                 timeout: float = TIMEOUT):
        try:
            host, port = split_hostport(listen)
        except ValueError as exc:
            raise ValueError(f"--metrics-listen: {exc}") from None
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self._server = _BoundedServer((host, port), family, workers, queued, timeout)
        except OSError as exc:
            raise RuntimeError(f"--metrics-listen {listen}: cannot listen ({exc.strerror or exc})") from exc
        self._server.set_app(make_wsgi_app(registry))
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-accept", daemon=True)
        self._thread.start()
        self.address = with_port(listen, self._server.server_port)
        log.info("metrics at http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class DaemonMetrics:
    """What both daemons' metrics share (``coordinator/monitoring.py``'s ``CoordinatorMonitor``,
    ``peer/monitoring.py``'s ``PeerMetrics`` build on it): a registry of their own (``registry``),
    ``fedrelay_<daemon>_refusals_total{method,code}``, the calls the daemon's guard refused with a
    gRPC status (:meth:`refused` is the guard's ``on_refusal``), and the ``/metrics`` endpoint
    (:meth:`serve_http`, :meth:`close`). ``daemon``: ``"coordinator"`` or ``"peer"``."""

    def __init__(self, daemon: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.refusals = Counter(f"fedrelay_{daemon}_refusals", "Calls refused with a gRPC status, by method and "
                                "status code.", ["method", "code"], registry=self.registry)
        self._http: MetricsServer | None = None

    def serve_http(self, listen: str) -> str:
        """Serve ``/metrics`` on ``listen`` (``HOST:PORT``); returns the bound address. Raises
        ``RuntimeError`` (cannot listen) or ``ValueError`` (not HOST:PORT)."""
        self._http = MetricsServer(listen, self.registry)
        return self._http.address

    def close(self) -> None:
        """Stop serving ``/metrics`` (nothing when it was not served)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def refused(self, method: str, code: grpc.StatusCode) -> None:
        """Count a call to ``method`` refused with ``code``."""
        self.refusals.labels(method, code_label(code)).inc()
