#!/bin/sh
# Where no container engine can build deploy/docker/Dockerfile (no registry for the base image):
# the image's steps by hand in a Debian bookworm root filesystem made by mmdebstrap, run with
# chroot in its own mount and PID namespace, as the image's user (uid 10001). Dependencies come
# from a bind-mounted site-packages (DEPS; default .venv's main.pth target or .venv's own) instead
# of the Dockerfile's dependency layer, so torch is not downloaded again. It installs fedrelay
# with `pip install --no-deps .` from `git archive HEAD`, installs healthcheck.sh as the image
# does, makes a PKI and a site kit, runs `start-peer.sh --check`, starts a coordinator and the
# kit's peer, and requires the HEALTHCHECK script to report both SERVING (and to fail on a dead
# port). Needs root, mmdebstrap, util-linux; about 2 minutes. Usage: sudo sh deploy/docker/rootfs_trial.sh
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${WORK:-$(mktemp -d /tmp/fedrelay-rootfs.XXXXXX)}
deps=${DEPS:-$(cat "$repo"/.venv/lib/python3.11/site-packages/main.pth 2>/dev/null || echo "$repo/.venv/lib/python3.11/site-packages")}
[ -f "$work/rootfs.tar" ] || mmdebstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$work/rootfs.tar"
root="$work/root"
rm -rf "$root" && mkdir -p "$root" && tar -xf "$work/rootfs.tar" -C "$root"
mkdir -p "$root/opt/fedrelay/src" "$root/deps"
git -C "$repo" archive HEAD | tar -x -C "$root/opt/fedrelay/src"
cp /etc/resolv.conf "$root/etc/resolv.conf"
if [ -n "${PIP_CERT:-}" ]; then mkdir -p "$root$(dirname "$PIP_CERT")" && cp "$PIP_CERT" "$root$PIP_CERT"; fi
cat > "$root/inside.sh" <<'INSIDE'
set -eu
groupadd --system --gid 10001 fedrelay
useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/fedrelay fedrelay 2>/dev/null
python3 -m venv /usr/local/fr
echo /deps > /usr/local/fr/lib/python3.11/site-packages/deps.pth
cd /opt/fedrelay/src && /usr/local/fr/bin/pip install -q --no-deps .
ln -s /usr/local/fr/bin/peer /usr/local/bin/peer; ln -s /usr/local/fr/bin/coordinator /usr/local/bin/coordinator
install -m 0755 deploy/docker/healthcheck.sh /usr/local/bin/fedrelay-healthcheck
cd /var/lib/fedrelay
U="setpriv --reuid 10001 --regid 10001 --clear-groups env HOME=/var/lib/fedrelay PATH=/usr/local/bin:/usr/bin:/bin"
$U coordinator init-ca --out pki --host coordinator >/dev/null
$U peer init --name site-00 --tls kit --host 127.0.0.1 >/dev/null   # the site's own key and request
$U coordinator enroll --csr kit/site-00.csr --ca pki --out kit --kit --port 50171 --coordinator 127.0.0.1:50170
$U /usr/local/fr/bin/python -c '
from PIL import Image
import os
for split in ("train", "test"):
    for c in ("a", "b"):
        os.makedirs(f"data/{split}/{c}", exist_ok=True)
        for i in range(4):
            Image.new("L", (28, 28), 40 * i + (100 if c == "b" else 0)).save(f"data/{split}/{c}/{i}.png")'
$U coordinator serve --listen 127.0.0.1:50170 --db ledger.sqlite --tls pki/coordinator > coord.log 2>&1 &
sed -i 's#^FEDRELAY_DATA=.*#FEDRELAY_DATA=/var/lib/fedrelay/data#; s#^FEDRELAY_STATE_DIR=.*#FEDRELAY_STATE_DIR=/var/lib/fedrelay/peer#; s#^FEDRELAY_TLS=.*#FEDRELAY_TLS=/var/lib/fedrelay/kit#; s#^FEDRELAY_DEVICE=.*#FEDRELAY_DEVICE=cpu#; s#^FEDRELAY_LISTEN=.*#FEDRELAY_LISTEN=127.0.0.1:50171#' kit/peer.env
$U kit/start-peer.sh kit/peer.env --check
$U kit/start-peer.sh kit/peer.env > peer.log 2>&1 &
ok() { for i in $(seq 1 90); do $U env "$@" fedrelay-healthcheck && return 0; sleep 1; done; return 1; }
ok FEDRELAY_ROLE=coordinator FEDRELAY_TLS=pki/coordinator FEDRELAY_HEALTH_ADDR=127.0.0.1:50170
ok FEDRELAY_ROLE=peer FEDRELAY_TLS=kit FEDRELAY_HEALTH_ADDR=127.0.0.1:50171
$U peer status --peer 127.0.0.1:50171 --tls kit
if $U env FEDRELAY_TLS=kit FEDRELAY_HEALTH_ADDR=127.0.0.1:50179 fedrelay-healthcheck; then exit 1; fi
echo "rootfs trial: ok"
INSIDE
# the PID namespace ends every process the trial started when its shell exits
unshare -m -p -f --mount-proc="$root/proc" sh -c "mount --bind -o ro '$deps' '$root/deps' && mount --bind /dev '$root/dev' && exec chroot '$root' /bin/sh /inside.sh"
