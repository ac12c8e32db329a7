"""The live run page: a read-only web view of the coordinator's ledger (``coordinator serve --web``).

:mod:`.views` turns the ledger into the page's JSON (site states, transfers, timeline, curves);
:mod:`.app` serves it (Starlette under uvicorn, in a thread of the coordinator); ``static/``
holds the page's HTML, CSS and JavaScript and the vendored charting library (no CDN).
"""

from fedrelay.coordinator.web.app import WebPage, create_app, parse_web_address, start_web

__all__ = ["WebPage", "create_app", "parse_web_address", "start_web"]
