"""This node's network links as launchpad reports them with its heartbeat: for each network
interface (loopback aside) whether it has carrier, its operational state and its error and drop
counters, and for each InfiniBand port its state and physical state. Interfaces are read through
netlink (``ip -j -s link``), which shows the launchpad's own network namespace (sysfs shows the
host's unless remounted: a container's or the dev cluster's nodes' view would be wrong);
InfiniBand ports from sysfs (not namespaced). Read off the event loop at once when netlink
announces a link change (``ip monitor link``), else every READ_EVERY_S; each interface carries
``changes``, how often its carrier came or went since launchpad started (a flap between two
heartbeats still counts). Sent at once when something changed (``on_change``), and every
REFRESH_BEATS heartbeats anyway. It only reports: what a link going down means for the job is
torchpassd's to decide (torchpassd/link_policy.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

INFINIBAND = Path("/sys/class/infiniband")
MAX_LINKS = 64  # a node with more interfaces (containers' veths) reports the first ones by name
READ_EVERY_S = 5.0
REFRESH_BEATS = 30
IP_TIMEOUT_S = 2.0


def _ip() -> str:
    """The ip tool: it lives in /usr/sbin, which a job's PATH often lacks."""
    return shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"


def ip_links() -> str:
    """``ip -j -s link show`` of this process's network namespace (JSON text; "[]" if ip fails)."""
    try:
        return subprocess.run([_ip(), "-j", "-s", "link", "show"], capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S, check=True).stdout or "[]"
    except (OSError, subprocess.SubprocessError):
        return "[]"


def interfaces(ip_json: str) -> dict[str, dict[str, Any]]:
    """``{name: {carrier, operstate, rx_errors, tx_errors, rx_dropped, tx_dropped}}`` from ``ip -j -s
    link`` output; anything it cannot read is left out."""
    try:
        entries = json.loads(ip_json)
    except ValueError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for e in entries if isinstance(entries, list) else []:
        name = e.get("ifname") if isinstance(e, dict) else None
        if not isinstance(name, str) or name == "lo" or len(out) >= MAX_LINKS:
            continue
        stats = e.get("stats64") if isinstance(e.get("stats64"), dict) else {}
        rx, tx = (stats.get(d) if isinstance(stats.get(d), dict) else {} for d in ("rx", "tx"))
        out[name] = {"carrier": "LOWER_UP" in (e.get("flags") or []), "operstate": e.get("operstate"),
                     "rx_errors": rx.get("errors"), "tx_errors": tx.get("errors"),
                     "rx_dropped": rx.get("dropped"), "tx_dropped": tx.get("dropped")}
    return out


def _word(path: Path) -> str | None:
    """"4: ACTIVE" -> "ACTIVE"; None when unreadable."""
    try:
        return path.read_text().split(":")[-1].strip()
    except (OSError, UnicodeDecodeError):
        return None


def ib_ports(root: Path = INFINIBAND) -> dict[str, dict[str, Any]]:
    """``{"mlx5_0/1": {state, phys_state}}`` for every InfiniBand port this node has."""
    out: dict[str, dict[str, Any]] = {}
    try:
        ports = sorted(p for hca in root.iterdir() for p in (hca / "ports").iterdir())
    except OSError:  # no InfiniBand here
        return out
    for port in ports[:MAX_LINKS]:
        out[f"{port.parent.parent.name}/{port.name}"] = {"state": _word(port / "state"),
                                                         "phys_state": _word(port / "phys_state")}
    return out


class LinkWatch:
    """The links part of each heartbeat (``{}`` when nothing changed since the last one sent).
    ``run()`` reads the links in a thread (``ip`` is a subprocess: never on the event loop's
    heartbeat path) whenever netlink announces a change, and every READ_EVERY_S anyway;
    ``heartbeat_part()`` only reports the last reading. ``read_ip``, ``infiniband`` and
    ``monitor`` (the argv printing a line per link event; None: poll only) are where the links are
    read from (tests stage them); ``on_change`` is called when a reading differs from the last."""

    def __init__(self, read_ip: Callable[[], str] = ip_links, infiniband: Path = INFINIBAND,
                 monitor: list[str] | None = None, on_change: Callable[[], None] = lambda: None) -> None:
        self.read_ip, self.infiniband, self.on_change = read_ip, infiniband, on_change
        self.monitor = [_ip(), "monitor", "link"] if monitor is None else monitor
        self._now: dict[str, dict[str, Any]] = {}
        self._sent: dict[str, dict[str, Any]] | None = None
        self._beats = 0
        self._changes: dict[str, int] = {}  # interface -> carrier changes seen

    def refresh(self) -> bool:
        """Read the links now (blocking: a subprocess and sysfs); True if they changed."""
        now = {**interfaces(self.read_ip()), **ib_ports(self.infiniband)}
        for name, link in now.items():
            before = self._now.get(name)
            if "carrier" in link:
                if before is not None and before.get("carrier") != link["carrier"]:
                    self._changes[name] = self._changes.get(name, 0) + 1
                link["changes"] = self._changes.get(name, 0)
        changed, self._now = now != self._now, now
        return changed

    async def run(self) -> None:
        events = await self._events()
        try:
            while True:
                if await asyncio.to_thread(self.refresh):
                    self.on_change()
                await self._next_event(events)
        finally:
            if events is not None and events.returncode is None:
                events.kill()
                await events.wait()

    async def _events(self) -> asyncio.subprocess.Process | None:
        if not self.monitor:
            return None
        try:
            return await asyncio.create_subprocess_exec(*self.monitor, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.DEVNULL)
        except OSError:  # no ip monitor: polling alone
            return None

    async def _next_event(self, events: asyncio.subprocess.Process | None) -> None:
        """Until netlink reports a link event (the burst it comes in read too), at most READ_EVERY_S."""
        if events is None or events.stdout is None or events.stdout.at_eof():
            await asyncio.sleep(READ_EVERY_S)
            return
        try:
            await asyncio.wait_for(events.stdout.readline(), READ_EVERY_S)
            while True:  # drain what came with it: one reading for the burst
                await asyncio.wait_for(events.stdout.readline(), 0.05)
        except TimeoutError:
            pass

    def heartbeat_part(self) -> dict[str, Any]:
        self._beats += 1
        if self._now == self._sent and self._beats < REFRESH_BEATS:
            return {}
        self._sent, self._beats = self._now, 0
        return {"links": self._now}
