"""This node's network links as launchpad reports them with its heartbeat: for each network
interface (loopback aside) its carrier, operational state and error and drop counters, and for each
InfiniBand port its state and physical state, all read from sysfs (the same read on every Linux
machine; tests point it at a directory tree to stage a link going down). A reading goes out when it
changed, and every REFRESH_BEATS heartbeats otherwise. It only reports: what a link going down
means for the job is torchpassd's to decide."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NET = Path("/sys/class/net")
INFINIBAND = Path("/sys/class/infiniband")
COUNTERS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
MAX_LINKS = 64  # a node with more interfaces (containers' veths) reports the first ones by name
REFRESH_BEATS = 30


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):  # e.g. carrier of an interface that is down: EINVAL
        return None


def _number(path: Path) -> int | None:
    text = _text(path)
    return int(text) if text is not None and text.isdigit() else None


def read(net: Path = NET, infiniband: Path = INFINIBAND) -> dict[str, dict[str, Any]]:
    """``{name: {...}}`` for every interface and InfiniBand port (``mlx5_0/1``) this node shows."""
    links: dict[str, dict[str, Any]] = {}
    names = sorted(p.name for p in net.iterdir() if p.name != "lo") if net.is_dir() else []
    for name in names[:MAX_LINKS]:
        d = net / name
        carrier = _number(d / "carrier")
        links[name] = {"carrier": None if carrier is None else carrier == 1, "operstate": _text(d / "operstate"),
                       **{c: _number(d / "statistics" / c) for c in COUNTERS}}
    hcas = sorted(infiniband.iterdir()) if infiniband.is_dir() else []
    for hca in hcas:
        ports = sorted((hca / "ports").iterdir()) if (hca / "ports").is_dir() else []
        for port in ports[:MAX_LINKS - len(links)]:
            # "4: ACTIVE", "5: LinkUp": keep the words
            state, phys = (_text(port / f) for f in ("state", "phys_state"))
            links[f"{hca.name}/{port.name}"] = {"state": state.split(":")[-1].strip() if state else None,
                                                "phys_state": phys.split(":")[-1].strip() if phys else None}
    return links


class LinkWatch:
    """The links part of each heartbeat (``{}`` when nothing changed since the last one sent)."""

    def __init__(self, net: Path = NET, infiniband: Path = INFINIBAND) -> None:
        self.net, self.infiniband = net, infiniband
        self._last: dict[str, dict[str, Any]] | None = None
        self._beats = 0

    def heartbeat_part(self) -> dict[str, Any]:
        try:
            now = read(self.net, self.infiniband)
        except OSError:  # sysfs unreadable: the heartbeat goes out without links
            return {}
        self._beats += 1
        if now == self._last and self._beats < REFRESH_BEATS:
            return {}
        self._last, self._beats = now, 0
        return {"links": now}
