"""``coordinator``: the coordinator daemon and the operator's commands.

This module holds the typer ``app`` (the console script ``coordinator``) and registers the
commands, in the order ``--help`` lists them; each lives in a module named for what it owns:

- ``daemon_commands``: ``serve``, ``relay``, ``health``
- ``run_commands``: ``start-chain`` (its method options generated from ``fedrelay.registry``),
  ``stop``, ``watch``
- ``ledger_commands``: ``show``, ``runs``, ``peers``, ``metrics``, ``fetch-model``, ``audit``,
  ``forget-peer``
- ``pki_commands``: ``init-ca``, ``enroll``, ``revoke``
- ``dataset_commands``: ``split-dataset``

with ``connection`` (the shared ``--coordinator``/``--tls`` options, the client, RPC errors as
exits), ``views`` (a run's summary and the tables) and ``live_view`` (``watch_view``) beside them.
"""

from __future__ import annotations

from fedrelay.cli import daemon_commands, dataset_commands, ledger_commands, pki_commands, run_commands
from fedrelay.cli.common import make_app, version_option
from fedrelay.cli.live_view import watch_view
from fedrelay.cli.views import render_summary

__all__ = ["app", "main", "render_summary", "watch_view"]

app = make_app("fedrelay coordinator: plans chains, assigns roles, keeps the ledger.",
               env_prefix="FEDRELAY_COORDINATOR")


@app.callback()
def main(version: bool = version_option()) -> None:
    """fedrelay coordinator: plans chains, assigns roles, keeps the ledger."""


for _name, _command in (
        ("serve", daemon_commands.serve),
        ("relay", daemon_commands.relay_command),
        ("start-chain", run_commands.start_chain),
        ("stop", run_commands.stop),
        ("forget-peer", ledger_commands.forget_peer),
        ("show", ledger_commands.show),
        ("runs", ledger_commands.runs),
        ("peers", ledger_commands.peers),
        ("watch", run_commands.watch),
        ("metrics", ledger_commands.metrics),
        ("fetch-model", ledger_commands.fetch_model),
        ("health", daemon_commands.health),
        ("audit", ledger_commands.audit),
        ("revoke", pki_commands.revoke),
        ("init-ca", pki_commands.init_ca),
        ("enroll", pki_commands.enroll),
        ("split-dataset", dataset_commands.split_dataset)):
    app.command(_name)(_command)
del _name, _command


if __name__ == "__main__":
    app()
