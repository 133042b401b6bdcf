#!/usr/bin/env bash
# Installs the Debian packages TorchPass and its dev cluster need (Debian 12 or 13), once.
# Services are NOT started here: the dev cluster starts its own private instances by PID.
set -euo pipefail

PKGS=(
  slurm-wlm slurmctld slurmd slurmdbd slurmrestd libslurm-dev slurm-client
  munge mariadb-server mosquitto mosquitto-clients openssl
  iproute2 procps psmisc util-linux bc curl gcc make sqlite3 ca-certificates
  python3 python3-venv python3-dev systemd
)
# Installed where the distribution has them: the JWT auth plugin lets slurmrestd take
# `scontrol token` JWTs over TCP (the dev cluster enables auth/jwt when the plugin is there).
OPTIONAL=(slurm-wlm-jwt-plugin)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
add_optional() {  # the optional packages apt knows of and that are not installed (nor listed yet)
  for p in "${OPTIONAL[@]}"; do
    installed "$p" || ! apt-cache show "$p" >/dev/null 2>&1 || [[ " ${missing[*]} " == *" $p "* ]] || missing+=("$p")
  done
}

missing=()
for p in "${PKGS[@]}"; do
  installed "$p" || missing+=("$p")
done
add_optional
if [ "${#missing[@]}" -eq 0 ]; then
  echo "[install-deps] all Debian packages present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[install-deps] missing packages: ${missing[*]}; run as root (or: sudo make setup)" >&2
  exit 1
fi
echo "[install-deps] Debian $(cat /etc/debian_version 2>/dev/null || echo '?'): installing ${missing[*]}"
# Keep apt from starting the system-wide services: the dev cluster runs private instances.
policy_added=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy_added=1
fi
trap '[ "$policy_added" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
add_optional  # a fresh machine's package lists are only there now
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "[install-deps] done"
