"""launchpad's link telemetry: each interface's carrier, state and error counters and each
InfiniBand port's state, read from sysfs (this machine's own, and a staged tree where a link goes
down), sent with the heartbeat when they change (and now and then anyway), and kept by torchpassd."""

from __future__ import annotations

import asyncio
from pathlib import Path

from launchpad.telemetry import links
from launchpad.telemetry.links import LinkWatch
from torchpass_common import protocol
from torchpassd.registry import Registry


def stage(root: Path, name: str, *, carrier: str | None, operstate: str, rx_errors: int = 0) -> None:
    d = root / "net" / name
    (d / "statistics").mkdir(parents=True, exist_ok=True)
    if carrier is None:
        (d / "carrier").unlink(missing_ok=True)  # what reading it gives on a down link: an error
    else:
        (d / "carrier").write_text(carrier + "\n")
    (d / "operstate").write_text(operstate + "\n")
    for counter in links.COUNTERS:
        (d / "statistics" / counter).write_text(f"{rx_errors if counter == 'rx_errors' else 0}\n")


def test_this_machines_interfaces_are_read() -> None:
    seen = links.read()
    assert "lo" not in seen
    names = [p.name for p in links.NET.iterdir() if p.name != "lo"]
    assert set(seen) == set(names[:links.MAX_LINKS]) and seen
    up = [v for v in seen.values() if v["operstate"] == "up"]
    assert all(v["carrier"] is True and isinstance(v["rx_errors"], int) for v in up)


def test_a_link_going_down_is_reported_at_the_next_heartbeat(tmp_path: Path) -> None:
    stage(tmp_path, "ib0", carrier="1", operstate="up")
    stage(tmp_path, "eth1", carrier="1", operstate="up")
    hca = tmp_path / "infiniband" / "mlx5_0" / "ports" / "1"
    hca.mkdir(parents=True)
    (hca / "state").write_text("4: ACTIVE\n")
    (hca / "phys_state").write_text("5: LinkUp\n")
    watch = LinkWatch(tmp_path / "net", tmp_path / "infiniband")
    first = watch.heartbeat_part()["links"]
    assert first["mlx5_0/1"] == {"state": "ACTIVE", "phys_state": "LinkUp"}
    assert first["ib0"] == {"carrier": True, "operstate": "up", "rx_errors": 0, "tx_errors": 0, "rx_dropped": 0,
                            "tx_dropped": 0}
    assert watch.heartbeat_part() == {}  # nothing changed
    stage(tmp_path, "ib0", carrier=None, operstate="down", rx_errors=17)
    (hca / "state").write_text("1: DOWN\n")
    now = watch.heartbeat_part()["links"]
    assert now["ib0"]["carrier"] is None and now["ib0"]["operstate"] == "down" and now["ib0"]["rx_errors"] == 17
    assert now["mlx5_0/1"]["state"] == "DOWN" and now["eth1"] == first["eth1"]
    for _ in range(links.REFRESH_BEATS - 1):
        assert watch.heartbeat_part() == {}
    assert watch.heartbeat_part()["links"] == now  # sent again now and then: a restarted torchpassd learns it


def test_no_sysfs_means_no_links_not_a_broken_heartbeat(tmp_path: Path) -> None:
    assert LinkWatch(tmp_path / "none", tmp_path / "none").heartbeat_part() == {"links": {}}


def test_torchpassd_keeps_the_last_links_a_launchpad_reported() -> None:
    registry = Registry()
    body = {"node": "n2", "seq": 1, "workers": [], "links": {"ib0": {"carrier": False, "operstate": "down"}}}

    async def feed() -> None:
        for b in (body, {**{k: v for k, v in body.items() if k != "links"}, "seq": 2}):
            await registry.on_message("n2", protocol.decode(protocol.encode(protocol.HEARTBEAT, job="4", gen=1, body=b)))
    asyncio.run(feed())
    assert registry.job("4").describe()["launchpads"]["n2"]["links"] == body["links"]
