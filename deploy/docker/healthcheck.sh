#!/bin/sh
# The image's HEALTHCHECK: the daemon's gRPC health service over mutual TLS with the container's
# own identity (FEDRELAY_TLS, default /tls). FEDRELAY_ROLE: peer (default) or coordinator;
# FEDRELAY_HEALTH_ADDR: where to dial it (default 127.0.0.1:50071, or :50070 for the coordinator).
# Docker reads 0 as healthy, 1 as unhealthy and reserves every other code: the health commands'
# codes (3 unreachable, 4 refused, 2 a bad option; docs/cli-conventions.md) become 1 here.
set -eu
role=${FEDRELAY_ROLE:-peer}
tls=${FEDRELAY_TLS:-/tls}
case "$role" in
  peer) peer health --peer "${FEDRELAY_HEALTH_ADDR:-127.0.0.1:50071}" --tls "$tls" --timeout 5 || exit 1 ;;
  coordinator) coordinator health --coordinator "${FEDRELAY_HEALTH_ADDR:-127.0.0.1:50070}" --tls "$tls" --timeout 5 \
    || exit 1 ;;
  *) echo "healthcheck: FEDRELAY_ROLE must be peer or coordinator, not $role" >&2; exit 1 ;;
esac
