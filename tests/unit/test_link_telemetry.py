"""launchpad's link telemetry: each interface's carrier, state and error counters (read through
netlink, so a network namespace sees its own links) and each InfiniBand port's state, sent with the
heartbeat when they change (and now and then anyway), and kept by torchpassd."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path

from launchpad.telemetry import links
from launchpad.telemetry.links import LinkWatch
from torchpass_common import protocol
from torchpassd.registry import Registry


def ip_entry(name: str, *, up: bool, rx_errors: int = 0) -> dict:
    """One interface as ``ip -j -s link`` prints it."""
    return {"ifname": name, "flags": ["BROADCAST", "UP", *(["LOWER_UP"] if up else [])],
            "operstate": "UP" if up else "LOWERLAYERDOWN",
            "stats64": {"rx": {"bytes": 10, "errors": rx_errors, "dropped": 0}, "tx": {"bytes": 9, "errors": 0, "dropped": 1}}}


def test_this_machines_interfaces_are_read_through_netlink() -> None:
    seen = links.interfaces(links.ip_links())
    names = [e["ifname"] for e in json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True,
                                                             check=True).stdout)]
    assert "lo" not in seen and set(seen) == {n for n in names if n != "lo"}
    assert all(isinstance(v["rx_errors"], int) and v["operstate"] for v in seen.values())
    assert any(v["carrier"] for v in seen.values())


def test_a_link_going_down_is_reported_at_the_next_read(tmp_path: Path) -> None:
    table = [ip_entry("lo", up=True), ip_entry("ib0", up=True), ip_entry("eth1", up=True)]
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    watch = LinkWatch(lambda: json.dumps(table), tmp_path)
    watch.refresh()
    first = watch.heartbeat_part()["links"]
    assert first["mlx5_0/1"] == {"state": "ACTIVE", "phys_state": "LinkUp"} and "lo" not in first
    assert first["ib0"] == {"carrier": True, "operstate": "UP", "rx_errors": 0, "tx_errors": 0, "rx_dropped": 0,
                            "tx_dropped": 1, "changes": 0}
    assert watch.heartbeat_part() == {}  # nothing changed
    table[1] = ip_entry("ib0", up=False, rx_errors=17)
    (port / "state").write_text("1: DOWN\n")
    assert watch.heartbeat_part() == {}  # reported as last read: read again only by the reading task
    watch.refresh()
    now = watch.heartbeat_part()["links"]
    assert now["ib0"]["carrier"] is False and now["ib0"]["operstate"] == "LOWERLAYERDOWN" and now["ib0"]["rx_errors"] == 17
    assert now["ib0"]["changes"] == 1 and now["eth1"]["changes"] == 0  # the carrier went once
    assert now["mlx5_0/1"]["state"] == "DOWN" and now["eth1"] == first["eth1"]
    for _ in range(links.REFRESH_BEATS - 1):
        assert watch.heartbeat_part() == {}
    assert watch.heartbeat_part()["links"] == now  # sent again now and then: a restarted torchpassd learns it


def test_unreadable_links_give_an_empty_report_not_a_broken_heartbeat(tmp_path: Path) -> None:
    for garbage in ("not json", "{}", '[{"ifname": 3}, 5, {"ifname": "x", "stats64": "?"}]'):
        watch = LinkWatch(lambda g=garbage: g, tmp_path / "none")
        watch.refresh()
        got = watch.heartbeat_part()["links"]
        assert set(got) <= {"x"} and all(v["rx_errors"] is None for v in got.values())


def test_torchpassd_keeps_the_last_links_a_launchpad_reported() -> None:
    registry = Registry()
    body = {"node": "n2", "seq": 1, "workers": [], "links": {"ib0": {"carrier": False, "operstate": "DOWN"}}}

    async def feed() -> None:
        for b in (body, {**{k: v for k, v in body.items() if k != "links"}, "seq": 2}):
            await registry.on_message("n2", protocol.decode(protocol.encode(protocol.HEARTBEAT, job="4", gen=1, body=b)))
    asyncio.run(feed())
    assert registry.job("4").describe()["launchpads"]["n2"]["links"] == body["links"]


def test_links_are_read_in_the_background_not_on_the_heartbeat_path(tmp_path: Path) -> None:
    reads: list[str] = []

    def slow_ip() -> str:
        reads.append(threading.current_thread().name)
        time.sleep(0.3)  # ip stuck for a moment: heartbeats must not wait for it
        return json.dumps([ip_entry("eth0", up=True)])

    async def go() -> tuple[float, dict]:
        watch = LinkWatch(slow_ip, tmp_path / "none", monitor=[])
        task = asyncio.create_task(watch.run())
        t0 = time.monotonic()
        first = watch.heartbeat_part()
        took = time.monotonic() - t0
        await asyncio.sleep(0.5)
        task.cancel()
        return took, {"first": first, "later": watch.heartbeat_part()}
    took, parts = asyncio.run(go())
    assert took < 0.05 and parts["first"] == {"links": {}}
    assert parts["later"]["links"]["eth0"]["carrier"] is True
    assert reads and all(name != threading.main_thread().name for name in reads)


def test_a_link_event_is_read_at_once_and_a_flap_between_heartbeats_still_counts(tmp_path: Path) -> None:
    """netlink announces each change (ip monitor link): the links are read again at once, not at the
    next poll, the heartbeat is asked for at once, and a carrier that went and came back between two
    heartbeats shows in the interface's change count."""
    table = [ip_entry("eth1", up=True)]
    beats: list[float] = []
    events = ["sh", "-c", "sleep 0.3; echo 2: eth1 down; sleep 0.3; echo 2: eth1 up; exec sleep 30"]

    def read() -> str:
        return json.dumps(table)

    async def go() -> dict:
        watch = LinkWatch(read, tmp_path / "none", monitor=events, on_change=lambda: beats.append(time.monotonic()))
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.1)
        watch.heartbeat_part()
        table[0] = ip_entry("eth1", up=False)
        await asyncio.sleep(0.35)
        table[0] = ip_entry("eth1", up=True)
        await asyncio.sleep(0.4)
        task.cancel()
        return watch.heartbeat_part()["links"]
    t0 = time.monotonic()
    got = asyncio.run(go())
    assert links.READ_EVERY_S > 1 and time.monotonic() - t0 < links.READ_EVERY_S  # events, not polls
    assert got["eth1"]["carrier"] is True and got["eth1"]["changes"] == 2
    assert len(beats) == 3  # the first reading, the drop, the return
