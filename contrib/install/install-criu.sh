#!/usr/bin/env bash
# Installs a private CRIU 4.2+ (Debian's package, default suite sid) for model-transparent migration.
# Debian 12 ships criu 3.17 (fails on current kernels: vdso) and 13 ships 4.1.1 (cannot dump a process
# holding an inet socket on kernels >= 6.16), so criu and the libraries it needs (a newer libc too)
# are fetched as .deb files with apt using a PRIVATE state dir and sources list (the system's apt
# sources, status and libc are never touched), unpacked under $TORCHPASS_CRIU_ROOT, and run through
# that root's own dynamic loader by the wrapper $TORCHPASS_CRIU_ROOT/bin/criu.
# Exit 0: a working criu is there (already, or now). Non-zero: why not, on stderr. Nothing else in
# TorchPass needs this: without it the CRIU tests are skipped with the reason.
set -euo pipefail

ROOT=${TORCHPASS_CRIU_ROOT:-/opt/torchpass/criu}
SUITE=${TORCHPASS_CRIU_SUITE:-sid}
MIRROR=${TORCHPASS_CRIU_MIRROR:-http://deb.debian.org/debian}
KEYRING=${TORCHPASS_CRIU_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
MIN_MAJOR=4 MIN_MINOR=2
WRAPPER=$ROOT/bin/criu

say() { echo "[install-criu] $*"; }
die() { echo "[install-criu] FAILED: $*" >&2; exit 1; }

version_ok() {  # "Version: 4.2.1" on stdin -> rc 0 when >= MIN
  awk -v M="$MIN_MAJOR" -v m="$MIN_MINOR" '/^Version:/ { split($2, v, "."); ok = (v[1] > M || (v[1] == M && v[2] >= m)) }
    END { exit ok ? 0 : 1 }'
}

if [ -x "$WRAPPER" ] && "$WRAPPER" --version 2>/dev/null | version_ok && "$WRAPPER" check >/dev/null 2>&1; then
  say "$("$WRAPPER" --version | head -1) already installed at $ROOT ('criu check' passes)"
  exit 0
fi

[ "$(uname -s)" = Linux ] || die "CRIU only runs on Linux"
command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "needs apt-get and dpkg (a Debian system)"
[ -r "$KEYRING" ] || die "Debian archive keyring $KEYRING not found (install debian-archive-keyring)"
mkdir -p "$ROOT" 2>/dev/null && [ -w "$ROOT" ] || die "cannot write $ROOT; run as root or set TORCHPASS_CRIU_ROOT"
ARCH=$(dpkg --print-architecture)
case "$ARCH" in
  amd64) TRIPLET=x86_64-linux-gnu LOADER=ld-linux-x86-64.so.2 ;;
  arm64) TRIPLET=aarch64-linux-gnu LOADER=ld-linux-aarch64.so.1 ;;
  *) die "architecture $ARCH is not supported by this installer" ;;
esac

APT=$ROOT/apt
rm -rf "$APT" "$ROOT/root.new"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs" "$ROOT/root.new"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" > "$APT/sources.list"
OPTS=(
  -oDir::Etc::SourceList="$APT/sources.list" -oDir::Etc::SourceParts=/dev/null
  -oDir::State::Lists="$APT/lists" -oDir::Cache="$APT/cache" -oDir::State::status=/dev/null
  -oAPT::Architecture="$ARCH" -oAPT::Architectures="$ARCH" -oDebug::NoLocking=1
  -oAcquire::Retries=1 -oAcquire::http::Timeout=20 -oAcquire::https::Timeout=20
)
say "fetching the $SUITE package index from $MIRROR (private apt state in $APT)"
timeout 180 apt-get "${OPTS[@]}" -qq --error-on=any update >"$APT/update.log" 2>&1 \
  || die "apt-get update of $SUITE from $MIRROR failed: $(tail -3 "$APT/update.log" | tr '\n' ' ')"
CANDIDATE=$(apt-cache "${OPTS[@]}" policy criu 2>/dev/null | awk '/Candidate:/ { print $2 }')
case "$CANDIDATE" in ""|"(none)") die "Debian $SUITE has no criu package for $ARCH" ;; esac
echo "Version: ${CANDIDATE#*:}" | version_ok \
  || die "Debian $SUITE has criu $CANDIDATE; TorchPass needs $MIN_MAJOR.$MIN_MINOR or newer (TORCHPASS_CRIU_SUITE=sid has it)"

# With an empty dpkg status, apt's plan lists criu and every library below it (libc included).
mapfile -t PKGS < <(apt-get "${OPTS[@]}" -s install --no-install-recommends criu 2>"$APT/plan.log" \
  | awk '$1 == "Inst" { print $2 "=" substr($3, 2) }')
[ "${#PKGS[@]}" -gt 0 ] || die "apt found no installable criu in $SUITE: $(tail -3 "$APT/plan.log" | tr '\n' ' ')"
say "downloading ${#PKGS[@]} packages: ${PKGS[*]}"
(cd "$APT/debs" && timeout 300 apt-get "${OPTS[@]}" -qq download "${PKGS[@]}" >"$APT/download.log" 2>&1) \
  || die "downloading the .deb files failed (see $APT/download.log)"
for deb in "$APT"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOT/root.new"; done

LIB=$ROOT/root/usr/lib/$TRIPLET
[ -e "$ROOT/root.new/usr/lib/$TRIPLET/$LOADER" ] || die "the unpacked libc has no usr/lib/$TRIPLET/$LOADER (a suite without merged /usr?)"
rm -rf "$ROOT/root" && mv "$ROOT/root.new" "$ROOT/root"
mkdir -p "$ROOT/bin"
cat > "$WRAPPER.new" <<EOF
#!/bin/sh
# TorchPass private criu ($SUITE), run with its own libc through its own loader; see install-criu.sh.
exec "$LIB/$LOADER" --library-path "$LIB" "$ROOT/root/usr/sbin/criu" "\$@"
EOF
chmod 755 "$WRAPPER.new" && mv "$WRAPPER.new" "$WRAPPER"
rm -rf "$APT/debs" "$APT/cache" "$APT/lists"

VERSION=$("$WRAPPER" --version 2>&1 | head -1) || die "the installed criu does not run: $VERSION"
echo "$VERSION" | version_ok || die "$SUITE ships $VERSION; TorchPass needs $MIN_MAJOR.$MIN_MINOR or newer"
if ! CHECK=$(timeout 60 "$WRAPPER" check 2>&1); then
  die "$VERSION installed at $ROOT, but 'criu check' fails on kernel $(uname -r): $(echo "$CHECK" | tail -3 | tr '\n' ' ')"
fi
say "$VERSION installed at $ROOT; 'criu check': $(echo "$CHECK" | tail -1)"
