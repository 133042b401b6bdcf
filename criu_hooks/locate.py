"""Finds a working criu: probes the candidates (TORCHPASS_CRIU, the private install made by
contrib/install/install-criu.sh, the system's criu) with `criu --version` and `criu check`, picks the
first that is 4.2 or newer and passes, and keeps every rejected candidate's reason for the report."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from criu_hooks.errors import CriuUnavailable
from torchpass_common import log

MIN_VERSION = (4, 2)
DEFAULT_ROOT = "/opt/torchpass/criu"
WHY_MIN = ("criu 3.17 (Debian 12) fails on current kernels (vdso), 4.1.1 (Debian 13) cannot dump a "
           "process holding an inet socket on kernels >= 6.16")
INSTALL_HINT = "run `bash contrib/install/install-criu.sh` as root (make setup does), or set TORCHPASS_CRIU"


@dataclass(frozen=True)
class Candidate:
    """One probed criu: where it came from, its version, and whether (and why not) it is usable."""

    source: str  # "env" (TORCHPASS_CRIU), "project" (install-criu.sh) or "system" (PATH)
    path: str
    version: tuple[int, ...] | None
    ok: bool
    reason: str

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "?"


def candidate_paths() -> list[tuple[str, str]]:
    """(source, path) pairs in order of preference; missing files are still listed (and rejected)."""
    out = []
    if os.environ.get("TORCHPASS_CRIU"):
        out.append(("env", os.environ["TORCHPASS_CRIU"]))
    root = os.environ.get("TORCHPASS_CRIU_ROOT", DEFAULT_ROOT)
    out.append(("project", os.path.join(root, "bin", "criu")))
    system = shutil.which("criu") or shutil.which("criu", path="/usr/sbin:/sbin")
    out.append(("system", system or "criu (not on PATH)"))
    return out


def parse_version(text: str) -> tuple[int, ...] | None:
    """The version in `criu --version` output ("Version: 4.2.1"), or None."""
    m = re.search(r"^Version:\s*(\d+(?:\.\d+)+)", text, re.MULTILINE)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def probe(source: str, path: str, *, timeout: float = 30.0) -> Candidate:
    """Run the candidate's --version and check; never raises."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return Candidate(source, path, None, False, "not installed")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout)
        version = parse_version(out.stdout)
        if version is None:
            return Candidate(source, path, None, False, f"does not run: {_tail(out.stdout + out.stderr)}")
        if version[:2] < MIN_VERSION:
            return Candidate(source, path, version, False,
                             f"too old: 4.2 or newer is needed ({WHY_MIN})")
        check = subprocess.run([path, "check"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Candidate(source, path, None, False, f"does not run: {e}")
    if check.returncode != 0:
        return Candidate(source, path, version, False,
                         f"`criu check` fails on kernel {os.uname().release}: {_tail(check.stdout + check.stderr)}")
    return Candidate(source, path, version, True, "`criu check`: Looks good")


def probe_all() -> list[Candidate]:
    """Every candidate, probed, in order of preference."""
    return [probe(source, path) for source, path in candidate_paths()]


@functools.cache
def find() -> Candidate:
    """The criu to use (first usable candidate); probed once per process. Raises CriuUnavailable
    with each candidate's reason when none works."""
    found = probe_all()
    for cand in found:
        if cand.ok:
            log.get().info("criu.chosen", path=cand.path, source=cand.source, version=cand.version_text,
                           rejected={c.path: c.reason for c in found if c is not cand and not c.ok})
            return cand
    raise CriuUnavailable(
        "no usable criu: " + "; ".join(f"{c.source} {c.path}: {c.reason}" for c in found),
        hint=INSTALL_HINT)


def _tail(text: str, lines: int = 2) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(no output)"
