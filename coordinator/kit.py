"""Site kits (``coordinator enroll --csr NAME.csr --kit``): one folder with everything a site's
administrator needs to run the site's peer daemon, except the site's private key: the site made
that itself (``peer init``) and keeps it; the kit holds the certificate the CA issued for it.

Layout of ``enroll --csr NAME.csr --ca PKI --out DIR --kit``::

    DIR/cert.pem, ca.pem                   the site's certificate and the CA's (``peer install-cert DIR``)
    DIR/peer.env                           settings, systemd EnvironmentFile syntax (comments on own lines)
    DIR/fedrelay-peer.service              the systemd unit (== deploy/systemd/fedrelay-peer.service)
    DIR/start-peer.sh                      runs the daemon from peer.env without systemd
    DIR/README.md                          ports to open, install steps, how to check it
"""

from __future__ import annotations

import os
from pathlib import Path

from fedrelay import names

#: The systemd unit; deploy/systemd/fedrelay-peer.service is this text (tests/test_deploy.py).
PEER_UNIT = r"""# fedrelay peer daemon for one site. Install (as root; a site kit from
# `coordinator enroll --csr NAME.csr --kit` holds this file, a filled-in peer.env and the certificates):
#   python3.11 -m venv /opt/fedrelay && /opt/fedrelay/bin/pip install /path/to/fedrelay
#   useradd --system --home /var/lib/fedrelay fedrelay
#   install -m 0644 fedrelay-peer.service /etc/systemd/system/
#   install -D -m 0640 -o root -g fedrelay peer.env.example /etc/fedrelay/peer.env   # then edit it
#   peer init --name site-3 --tls /etc/fedrelay/tls --host HOST   (the site's own key; send site-3.csr to the operator)
#   peer install-cert site-3.kit --tls /etc/fedrelay/tls && chgrp -R fedrelay /etc/fedrelay/tls && chmod 0750 /etc/fedrelay/tls
#   sudo -u fedrelay /opt/fedrelay/bin/peer serve --check ...   (see the kit's README.md)
#   systemctl daemon-reload && systemctl enable --now fedrelay-peer
# Restart=always restarts it with the same command after a crash or reboot: the daemon then
# carries on from the last finished step of every run in its state dir (hop-level resume).
# ${VAR} (braces) passes each value as exactly one argument, spaces included.
[Unit]
Description=fedrelay peer daemon (one site of a federated-learning chain)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User=fedrelay
Group=fedrelay
EnvironmentFile=/etc/fedrelay/peer.env
ExecStart=/opt/fedrelay/bin/peer serve \
    --data ${FEDRELAY_DATA} --name ${FEDRELAY_NAME} \
    --listen ${FEDRELAY_LISTEN} --advertise ${FEDRELAY_ADVERTISE} \
    --coordinator ${FEDRELAY_COORDINATOR} \
    --state-dir ${FEDRELAY_STATE_DIR} --device ${FEDRELAY_DEVICE} \
    --tls ${FEDRELAY_TLS}
Restart=always
RestartSec=5
KillSignal=SIGTERM
TimeoutStopSec=30
StateDirectory=fedrelay
StateDirectoryMode=0750
UMask=0077
# Hardening (systemd-analyze security --offline=true: 1.8 on systemd 252). The daemon reads its data and TLS folder and writes
# only /var/lib/fedrelay (FEDRELAY_STATE_DIR must lie under it, or add ReadWritePaths= in a drop-in).
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ReadWritePaths=/var/lib/fedrelay
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictSUIDSGID=yes
RestrictNamespaces=yes
RestrictRealtime=yes
LockPersonality=yes
RemoveIPC=yes
CapabilityBoundingSet=
AmbientCapabilities=
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
# GPU: no PrivateDevices= (it would hide /dev/nvidia*) and no MemoryDenyWriteExecute= (CUDA and
# oneDNN generate code at run time); the device cgroup allows the NVIDIA devices and the
# pseudo-devices of DevicePolicy=closed, nothing else. Load the nvidia and nvidia-uvm modules at
# boot (e.g. nvidia-persistenced): ProtectKernelModules= stops the daemon from loading them.
DevicePolicy=closed
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-uvm rw
DeviceAllow=char-nvidia-caps rw
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw

[Install]
WantedBy=multi-user.target
"""

#: Variables of peer.env, in file order, each with its comment; the unit uses every one.
ENV_VARS = ("FEDRELAY_NAME", "FEDRELAY_DATA", "FEDRELAY_LISTEN", "FEDRELAY_ADVERTISE", "FEDRELAY_COORDINATOR",
            "FEDRELAY_DEVICE", "FEDRELAY_STATE_DIR", "FEDRELAY_TLS")

PLACEHOLDER_COORDINATOR = "coordinator.example.org:50070"


#: Read by ``peer serve`` from its environment (``--outbound-only``), not passed by the unit.
OUTBOUND_VAR = "FEDRELAY_OUTBOUND_ONLY"


def env_text(name: str, *, advertise: str, listen: str, coordinator: str | None, data: str = "/srv/fedrelay/site",
             device: str = "auto", state_dir: str = "/var/lib/fedrelay/peer", tls: str = "/etc/fedrelay/tls",
             outbound_only: bool = False) -> str:
    """The kit's ``peer.env``: systemd EnvironmentFile syntax, one ``KEY=VALUE`` per line, comments
    only on lines of their own, no quotes or backslashes needed (values are checked to hold no
    whitespace, quote, backslash, ``#``, ``;`` or ``$``). ``outbound_only``: the site accepts no
    inbound connection (``FEDRELAY_OUTBOUND_ONLY=1``, no advertised address, listening on
    loopback for its own administrator only). Raises ``ValueError`` for a bad value."""
    coord = coordinator or PLACEHOLDER_COORDINATOR
    values = {"FEDRELAY_NAME": name, "FEDRELAY_DATA": data, "FEDRELAY_LISTEN": listen,
              "FEDRELAY_ADVERTISE": advertise, "FEDRELAY_COORDINATOR": coord, "FEDRELAY_DEVICE": device,
              "FEDRELAY_STATE_DIR": state_dir, "FEDRELAY_TLS": tls}
    for key, value in values.items():
        if key == "FEDRELAY_ADVERTISE" and outbound_only and not value:
            continue
        if not value or any(c in value for c in " \t\n\"'\\#;$"):
            raise ValueError(f"{key}={value!r}: a kit value must not be empty or hold spaces, quotes, "
                             "backslashes, '#', ';' or '$'")
    coord_note = ("# The coordinator's HOST:PORT." if coordinator else
                  "# The coordinator's HOST:PORT: a PLACEHOLDER, replace it with the address your coordinator's\n"
                  "# operator gave you (enroll --kit --coordinator HOST:PORT fills it in).")
    if outbound_only:
        reach = f"""# This site accepts no inbound connection: it keeps a control stream open to the coordinator
# and receives its models through the coordinator's relay, sealed to its certificate key.
{OUTBOUND_VAR}=1
# Where the daemon listens for this host's own administrator only (peer status, peer health).
FEDRELAY_LISTEN={listen}
# Empty: other sites and the coordinator never dial this site.
FEDRELAY_ADVERTISE=
"""
    else:
        reach = f"""# 0: other sites and the coordinator dial this site (1: it connects out only; see the kit's README).
{OUTBOUND_VAR}=0
# Where the daemon listens (inbound: from the predecessor site(s) and the coordinator).
FEDRELAY_LISTEN={listen}
# What the other sites and the coordinator dial to reach this site.
FEDRELAY_ADVERTISE={advertise}
"""
    return f"""# /etc/fedrelay/peer.env: site {name}'s settings for fedrelay-peer.service and start-peer.sh.
# systemd's rules: KEY=VALUE, comments only on lines of their own (a "#" after a value becomes
# part of the value). After an edit, check with the command in README.md ("Check it").
#
# The site's name: the name in this kit's certificate.
FEDRELAY_NAME={name}
# The site folder: train/<class>/*.png|jpg and optionally test/<class>/*; readable by user fedrelay.
FEDRELAY_DATA={data}
{reach}{coord_note}
FEDRELAY_COORDINATOR={coord}
# auto (a GPU when one is usable), cpu or cuda:N.
FEDRELAY_DEVICE={device}
# Runs and models; under systemd it must lie under /var/lib/fedrelay (the unit's only writable folder).
FEDRELAY_STATE_DIR={state_dir}
# The folder holding the site's key.pem (from `peer init`) and this kit's cert.pem and ca.pem.
FEDRELAY_TLS={tls}
"""


START_SCRIPT = r"""#!/bin/sh
# Runs this site's peer daemon without systemd, with the settings of peer.env (KEY=VALUE lines;
# comments on their own lines). Usage: ./start-peer.sh [peer.env] [extra peer serve options]
# PEER=/path/to/peer overrides the command (default: `peer` on PATH, else /opt/fedrelay/bin/peer).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
env_file=${1:-$here/peer.env}
[ $# -gt 0 ] && shift
[ -r "$env_file" ] || { echo "start-peer.sh: cannot read $env_file" >&2; exit 1; }
set -a
. "$env_file"
set +a
peer=${PEER:-$(command -v peer || echo /opt/fedrelay/bin/peer)}
exec "$peer" serve --data "$FEDRELAY_DATA" --name "$FEDRELAY_NAME"     --listen "$FEDRELAY_LISTEN" --advertise "$FEDRELAY_ADVERTISE"     --coordinator "$FEDRELAY_COORDINATOR" --state-dir "$FEDRELAY_STATE_DIR"     --device "$FEDRELAY_DEVICE" --tls "$FEDRELAY_TLS" "$@"
"""


def readme_text(name: str, *, port: int, advertise: str, coordinator: str | None, outbound_only: bool = False) -> str:
    """The kit's README.md: ports and directions (none inbound for a site that connects out only),
    install steps (systemd or the start script), how to check the daemon."""
    coord = coordinator or "the coordinator (see peer.env)"
    if outbound_only:
        network = f"""| direction | from / to | port | why |
|---|---|---|---|
| inbound | nobody | none | this site connects out only (`FEDRELAY_OUTBOUND_ONLY=1`) |
| outbound | the coordinator ({coord}) | its port | registration, heartbeats, reports; the control stream over which the coordinator's calls come; the relay, where models for this site wait sealed to its key |
| outbound | the successor site(s) (any site of the federation) | their listen port | models leave (a successor that cannot be reached directly gets them through the relay) |

Every connection is mutual TLS with this kit's certificate. The daemon listens on
`{advertise}` for this host's administrator only (`peer status`, `peer health`): keep that port
closed to the outside. A model for this site never lies readable at the relay: the sender seals
it to this site's key and signs it; this site checks the signature and the model as it would a
direct transfer."""
    else:
        network = f"""| direction | from / to | port | why |
|---|---|---|---|
| inbound | the predecessor site(s) in a chain, and the aggregating site of a star run | TCP {port} | models arrive |
| inbound | the coordinator ({coord}) | TCP {port} | assignments, evaluation, status |
| outbound | the coordinator ({coord}) | its port | registration, heartbeats, reports |
| outbound | the successor site(s) (any site of the federation) | their listen port | models leave |

Every connection is mutual TLS with this kit's certificate. Other sites and the coordinator
dial this site at `{advertise}` (`FEDRELAY_ADVERTISE`). Where the site's IT allows no inbound
connection, enrol it with `--kit --outbound-only` (or set `FEDRELAY_OUTBOUND_ONLY=1`, empty
`FEDRELAY_ADVERTISE` and a loopback `FEDRELAY_LISTEN`): it then connects out only."""
    return f"""# Site kit for `{name}` (fedrelay)

This folder holds what site `{name}` needs to run its fedrelay peer daemon, except its private
key: the site made that itself (`peer init`), and it never leaves the site.

| file | what it is |
|---|---|
| `cert.pem`, `ca.pem` | the site's certificate (for the key `peer init` made here) and the federation's CA certificate |
| `peer.env` | the daemon's settings (systemd EnvironmentFile syntax: `KEY=VALUE`, comments on their own lines) |
| `fedrelay-peer.service` | the systemd unit (hardened; GPU devices allowed) |
| `start-peer.sh` | runs the daemon from `peer.env` on a host without systemd |

## Network: ports and directions

{network}

## Install with systemd (as root)

    python3.11 -m venv /opt/fedrelay && /opt/fedrelay/bin/pip install /path/to/fedrelay
    useradd --system --home /var/lib/fedrelay fedrelay
    install -m 0644 fedrelay-peer.service /etc/systemd/system/
    install -D -m 0640 -o root -g fedrelay peer.env /etc/fedrelay/peer.env
    # the key made by `peer init --name {name} --tls /etc/fedrelay/tls` stays there; add the certificates:
    peer install-cert . --tls /etc/fedrelay/tls
    chgrp -R fedrelay /etc/fedrelay/tls && chmod 0750 /etc/fedrelay/tls && chmod 0640 /etc/fedrelay/tls/key.pem
    # edit /etc/fedrelay/peer.env (FEDRELAY_DATA at least), then check it (next section)
    systemctl daemon-reload && systemctl enable --now fedrelay-peer
    journalctl -u fedrelay-peer -f

The data folder must be readable by the user `fedrelay`; the unit writes only under
`/var/lib/fedrelay`. With a GPU, load the NVIDIA kernel modules at boot (e.g. enable
`nvidia-persistenced`): the unit cannot load kernel modules.

## Without systemd

    ./start-peer.sh                 # reads ./peer.env; set FEDRELAY_TLS to this folder first
    ./start-peer.sh /etc/fedrelay/peer.env --verbose

## Check it

Before starting: validate every setting exactly as `peer serve` would (loads the data, checks
the identity, the addresses, the device and the state dir; listens on nothing):

    sudo -u fedrelay sh -c 'set -a; . /etc/fedrelay/peer.env; /opt/fedrelay/bin/peer serve --check \\
        --data "$FEDRELAY_DATA" --name "$FEDRELAY_NAME" --listen "$FEDRELAY_LISTEN" \\
        --advertise "$FEDRELAY_ADVERTISE" --coordinator "$FEDRELAY_COORDINATOR" \\
        --state-dir "$FEDRELAY_STATE_DIR" --device "$FEDRELAY_DEVICE" --tls "$FEDRELAY_TLS"'
    ./start-peer.sh peer.env --check     # the same without systemd

While it runs, with the site's own identity (the daemon answers its own site and the coordinator):

    peer health --peer {advertise} --tls /etc/fedrelay/tls   # exits 0 when SERVING
    peer status --peer {advertise} --tls /etc/fedrelay/tls   # its runs, and its link to the coordinator
"""


def write_kit(out: Path, name: str, *, hosts: tuple[str, ...] | list[str], coordinator: str | None,
              port: int = 50071, outbound_only: bool = False) -> list[Path]:
    """Write the kit's files (all but the identity, which ``enroll`` writes) into ``out``.
    The advertised host is the first of ``hosts`` (the certificate's SAN names); a site that
    connects out only (``outbound_only``) advertises nothing and listens on 127.0.0.1:``port``.
    Returns the paths written. Raises ``ValueError`` for a bad coordinator address or port."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be 1-65535, not {port}")
    if coordinator is not None:
        names.check_address(coordinator, "--coordinator")
    host = hosts[0]
    advertise = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    names.check_address(advertise, "--advertise (first --host and --port)")
    listen = f"127.0.0.1:{port}" if outbound_only else f"0.0.0.0:{port}"
    env = env_text(name, advertise="" if outbound_only else advertise, listen=listen, coordinator=coordinator,
                   outbound_only=outbound_only)
    readme = readme_text(name, port=port, advertise=listen if outbound_only else advertise, coordinator=coordinator,
                         outbound_only=outbound_only)
    files = {"peer.env": (env, 0o640), "fedrelay-peer.service": (PEER_UNIT, 0o644),
             "start-peer.sh": (START_SCRIPT, 0o755), "README.md": (readme, 0o644)}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, (text, mode) in files.items():
        path = out / fname
        path.write_text(text)
        os.chmod(path, mode)
        written.append(path)
    return written
