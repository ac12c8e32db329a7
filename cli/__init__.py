"""Typer apps behind the console scripts `peer`, `coordinator` and `fedrelay` (no logic of their own).

gRPC's C core writes its own log lines on stderr (``E1127 13:26:15.538056 22732 add_port.cc:83]
...``: no year, no UTC offset, outside fedrelay's log format); the commands keep it quiet unless
``GRPC_VERBOSITY`` is set (e.g. ``GRPC_VERBOSITY=debug`` to debug a connection). What such a line
would report reaches fedrelay as an error or a status, which it logs or prints itself. It is set
here, before anything imports grpc, because the C core reads it once, at import.

The method registry is loaded here too, before any command module reads it: a bad
``FEDRELAY_METHODS`` (a plug-in that cannot be imported) ends the command with a one-line message
instead of a traceback.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "NONE")

try:
    from fedrelay import registry as _registry  # noqa: E402,F401 - loads FEDRELAY_METHODS' plug-ins
except RuntimeError as exc:  # registry.PluginError (the class cannot be named: its module failed to load)
    raise SystemExit(f"error: {exc}") from None
