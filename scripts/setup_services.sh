#!/usr/bin/env bash
# Install what the Dynamo tests and `python -m syncd.engine.dynamo.serve --start-services` need that pip cannot:
# Debian's etcd-server and nats-server (the production-style discovery path). Idempotent: does nothing when
# both binaries are there; installs with apt-get when running as root; otherwise says what to install.
# The packages' own services are not started or enabled here: syncd starts its own servers on free ports.
set -euo pipefail
missing=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || missing+=(etcd-server)
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup_services: etcd and nats-server present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_services: please install ${missing[*]} (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d keeps the packages' post-install scripts from starting system services
rcd=/usr/sbin/policy-rc.d
created_rcd=0
if [ ! -e "$rcd" ]; then printf '#!/bin/sh\nexit 101\n' > "$rcd"; chmod +x "$rcd"; created_rcd=1; fi
trap '[ "$created_rcd" = 1 ] && rm -f "$rcd"' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup_services: installed ${missing[*]}"
