"""What ``coordinator forget-peer`` means for a daemon still running under the forgotten name.

Forgetting removes a site's registration, and the ledger remembers the removal with the daemon
instance that was registered (the random id a daemon process draws when it starts,
``RegisterRequest.instance``). That daemon's next heartbeats are refused (PERMISSION_DENIED, the
message says why and what to do): the operator's decision holds, also across coordinator
restarts. A daemon started afterwards (a new instance: the site's administrator restarted it)
registers anew, and the removal record is dropped. A registration without an instance id (not
a fedrelay daemon) cannot be told apart from the forgotten one and stays refused.

To keep a site out for good, stop its daemon; to keep its certificate from being used at all,
the federation's CA must stop trusting it (docs/explanation/security.md).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("fedrelay.coordinator")


def refusal(ledger, request) -> str | None:
    """Why the ``RegisterRequest`` ``request`` is refused because its name was forgotten, or
    None (it may register: never forgotten, or a new daemon instance, whose removal record is
    then dropped)."""
    gone = ledger.forgotten(request.name)
    if gone is None:
        return None
    if request.instance and request.instance != gone["instance"]:
        ledger.unforget(request.name)
        log.info("site %s: a new daemon (instance %s) registers the name the operator removed", request.name,
                 request.instance)
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gone["time"]))
    return (f"site {request.name!r} was removed by the coordinator's operator (forget-peer) at {when}; this daemon "
            "may not register again: restart it to register anew, or stop it")
