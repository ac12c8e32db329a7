"""The live run page's web server: Starlette routes under uvicorn, in a thread of the coordinator.

Read-only (GET only) and without authentication: bound to 127.0.0.1 unless told otherwise.
Routes:

- ``/``: the list of runs; ``/runs/{run_id}``: one run (an unknown run: a 404 page);
- ``/api/runs``: JSON list (:func:`.views.run_list`); ``/api/runs/{run_id}``: JSON of one run
  (:func:`.views.run_view`; an unknown run: 404 ``{"error": ...}``);
- ``/runs/{run_id}/events``: server-sent events, one per ledger event of the run (``id:`` the
  ledger's seq; ``data:`` JSON with seq, time, kind, site, message), resumable with the
  ``Last-Event-ID`` header (or ``?after=SEQ``); a final ``event: end`` once the run has ended;
- ``/static/...``: the page's files and the vendored uPlot (no CDN: the page works offline).
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import json
import logging
import socket
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fedrelay import limits
from fedrelay.coordinator.http_limits import HostCheck, HttpLimits, allowed_hosts
from fedrelay.coordinator.ledger import TERMINAL
from fedrelay.coordinator.web import views
from fedrelay.coordinator.web.cache import PageCache

log = logging.getLogger("fedrelay.coordinator.web")

STATIC = Path(__file__).resolve().parent / "static"
DEFAULT_HOST = "127.0.0.1"
KEEPALIVE_S = 15.0   # a comment line on an idle event stream, so that a gone browser is noticed
WAIT_S = 1.0         # an idle stream looks at ``stopping`` at least this often (seconds)
HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _not_found(what: str) -> HTMLResponse:
    body = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>not found · fedrelay</title>"
            f"<link rel=stylesheet href=/static/page.css></head><body><main class=notfound>"
            f"<h1>Not found</h1><p id=notfound>{html.escape(what)}</p><p><a href=/>all runs</a></p>"
            f"</main></body></html>")
    return HTMLResponse(body, status_code=404, headers=HEADERS)


class _Wakeup:
    """An ``asyncio.Event`` of the server's loop that the coordinator's event hub
    (``coordinator/events.py``) sets, from whichever thread committed an event of the run: an
    open stream sleeps until its run has news, with no thread per stream and no polling."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def __call__(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the server's loop has closed: nothing left to wake
            pass

    async def wait(self, timeout: float) -> None:
        """Return when woken (the flag is cleared) or after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            pass
        self.event.clear()


def create_app(service, stopping: threading.Event | None = None, hosts: frozenset[str] | None = None) -> Starlette:
    """The page's ASGI app over a ``CoordinatorService`` (its ``summary()`` and ``ledger``).
    ``stopping``, once set, ends every open event stream. ``hosts``: the names a request's
    ``Host:`` may carry besides IP literals (``http_limits.allowed_hosts``; default: the
    localhost names); any other is answered 400 (DNS rebinding)."""
    ledger = service.ledger
    stopping = stopping or threading.Event()
    hub = service.events
    cache = PageCache(lambda run_id: views.run_view(service, run_id),
                      lambda run_id: (hub.last_seq(run_id), hub.ended(run_id)))
    # The run list (polled every 3 s by each reader of the index page): rebuilt on a new event.
    run_list = PageCache(lambda _: views.run_list(ledger), lambda _: ledger.last_event_seq(), size=1, stamp=False)

    def page(name: str) -> Response:
        return FileResponse(STATIC / name, media_type="text/html", headers=HEADERS)

    def index(request: Request) -> Response:
        return page("index.html")

    def run_page(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if ledger.run(run_id) is None:
            return _not_found(f"no run {run_id!r} in this coordinator's ledger")
        return page("run.html")

    def api_runs(request: Request) -> Response:
        return Response(run_list.get(""), media_type="application/json", headers=HEADERS)

    def api_run(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        body = cache.get(run_id)  # built once per change of the run (web/cache.py)
        if body is None:
            return JSONResponse({"error": f"unknown run {run_id!r}"}, status_code=404, headers=HEADERS)
        return Response(body, media_type="application/json", headers=HEADERS)

    async def events(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if await asyncio.to_thread(ledger.run, run_id) is None:
            return _not_found(f"no run {run_id!r} in this coordinator's ledger")
        raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
        try:
            after = max(0, int(raw))
        except ValueError:
            return JSONResponse({"error": f"Last-Event-ID / after must be a ledger seq (an integer), got {raw!r}"},
                                status_code=400, headers=HEADERS)
        return StreamingResponse(_stream(service, run_id, after, stopping), media_type="text/event-stream",
                                 headers={**HEADERS, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    routes = [
        Route("/", index),
        Route("/runs/{run_id}", run_page),
        Route("/runs/{run_id}/events", events),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}", api_run),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    async def not_found(request: Request, exc) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": "not found"}, status_code=404, headers=HEADERS)
        return _not_found(f"nothing at {request.url.path}")

    app = Starlette(routes=routes, exception_handlers={404: not_found})
    app.state.page_cache = cache
    app.add_middleware(HostCheck, names=hosts if hosts is not None else allowed_hosts("localhost"))
    return app


async def _stream(service, run_id: str, seq: int, stopping: threading.Event):
    """Server-sent events of ``run_id`` after ledger seq ``seq``, until the run has ended and
    every event was sent, the client goes, or ``stopping`` is set. Events come from the
    coordinator's event hub (memory, after at most one ledger read to catch up)."""
    hub = service.events
    wake = _Wakeup()
    token = hub.subscribe(run_id, wake)
    try:
        run = await asyncio.to_thread(service.ledger.run, run_id)  # after subscribing: an end after it wakes us
        ended = run is None or run["status"] in TERMINAL
        yield "retry: 2000\n\n"
        idle_since = time.monotonic()
        while not stopping.is_set():
            events = await asyncio.to_thread(hub.events_after, run_id, seq)
            for e in events:
                seq = e["seq"]
                data = {k: e[k] for k in ("seq", "time", "kind", "site", "message")}
                yield f"id: {seq}\ndata: {json.dumps(data)}\n\n"
            if events:
                idle_since = time.monotonic()
                continue
            if ended or hub.ended(run_id):
                if not ended:
                    run = await asyncio.to_thread(service.ledger.run, run_id)
                yield f"event: end\ndata: {json.dumps({'status': run['status'] if run else 'unknown'})}\n\n"
                return
            await wake.wait(WAIT_S)
            if time.monotonic() - idle_since > KEEPALIVE_S:
                idle_since = time.monotonic()
                yield ": keepalive\n\n"
    finally:
        hub.unsubscribe(run_id, token)


def parse_web_address(address: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); a bare port binds 127.0.0.1.
    Raises ``ValueError`` with the expected form."""
    text = address.strip()
    if text.isdigit():
        host, port = DEFAULT_HOST, int(text)
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep or not host or not port_s.isdigit():
            raise ValueError(f"--web {address!r}: expected PORT or HOST:PORT (e.g. 127.0.0.1:8070)")
        host, port = host.strip("[]"), int(port_s)
    if port > 65535:
        raise ValueError(f"--web {address!r}: the port must be at most 65535")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class WebPage:
    """The running page server: ``url`` (``http://HOST:PORT/``), ``port``; :meth:`stop` ends it."""

    def __init__(self, server, thread: threading.Thread, sock: socket.socket, stopping: threading.Event):
        self._server, self._thread, self._sock, self._stopping = server, thread, sock, stopping
        host, self.port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def stop(self, timeout: float = 5.0) -> None:
        """End open event streams and the server; waits up to ``timeout`` seconds."""
        self._stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        self._sock.close()


def start_web(address: str, service, *, hosts: list[str] | tuple[str, ...] = (),
              limits_: HttpLimits | None = None) -> WebPage:
    """Serve the live run page of ``service``'s ledger on ``address`` (see
    :func:`parse_web_address`) in a daemon thread; returns once it accepts connections.
    ``hosts``: host names a request's ``Host:`` may carry besides the listen host, the
    localhost names and IP literals (``coordinator serve --web-host``); ``limits_``: the
    listener's bounds (``http_limits.HttpLimits``; the defaults when None).
    Warns (log) when the address is not loopback: the page has no authentication. Raises
    ``ValueError`` for a malformed address or host name, ``RuntimeError`` if it cannot bind."""
    import uvicorn

    host, port = parse_web_address(address)
    names = allowed_hosts(host, hosts)
    options = (limits_ or HttpLimits()).uvicorn_options()
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(options["backlog"])
    except OSError as exc:
        raise RuntimeError(f"--web {address}: cannot listen there ({exc.strerror or exc})") from None
    stopping = threading.Event()
    limits.quiet_logs()  # no line or traceback per connection under a flood
    config = uvicorn.Config(create_app(service, stopping, names), log_config=None, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=2, server_header=False,
                            **options)
    server = uvicorn.Server(config)

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # a server thread that fails says so
            log.error("the live run page's server stopped: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=run, name="web-page", daemon=True)
    thread.start()
    page = WebPage(server, thread, sock, stopping)
    page.protocol = options["http"]  # its ``counts``: connections refused, heads timed out
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        page.stop()
        raise RuntimeError(f"--web {address}: the page's server did not start (see the log above)")
    log.info("live run page at %s (read-only)", page.url)
    if not is_loopback(host):
        log.warning("the live run page listens on %s, not loopback: it has no authentication, anyone who "
                    "reaches that address can read every run's plan, sites and metrics", host)
    return page
