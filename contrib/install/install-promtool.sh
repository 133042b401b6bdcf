#!/usr/bin/env bash
# Installs promtool, which checks contrib/prometheus's alert rules (tests/unit/test_operator_dashboards.py),
# from Debian's prometheus package WITHOUT installing that package: the .deb is downloaded with apt and
# only its promtool binary is unpacked to $TORCHPASS_PROMTOOL_ROOT/promtool, so no Prometheus server is
# installed, enabled or started. Exit 0: promtool is there (already, or now); non-zero: why not, on stderr.
set -euo pipefail

ROOT=${TORCHPASS_PROMTOOL_ROOT:-/opt/torchpass/prometheus}
BIN=$ROOT/promtool

say() { echo "[install-promtool] $*"; }
die() { echo "[install-promtool] FAILED: $*" >&2; exit 1; }

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  say "$("$BIN" --version 2>&1 | head -1) already at $BIN"
  exit 0
fi
[ "$(id -u)" = 0 ] || die "run as root (or: sudo make setup) to install $BIN"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
( cd "$work" && { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus >/dev/null; }; } ) \
  || die "apt-get download prometheus failed (is Debian's package list reachable?)"
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
[ -x "$work/root/usr/bin/promtool" ] || die "the prometheus package holds no usr/bin/promtool"
mkdir -p "$ROOT"
install -m 0755 "$work/root/usr/bin/promtool" "$BIN"
say "$("$BIN" --version 2>&1 | head -1) installed at $BIN"
