"""The scale benchmark's plumbing, small: 72 simulated nodes (4 racks of 18 trays, 2 spares each)
heartbeat through a real mosquitto to a real torchpassd (simulated Slurm); each drain gets a
decision with a spare of the reservation, and the latency and CPU figures are sane."""

from __future__ import annotations

import pytest

from bench import scale

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]


def test_scale_simulation_small_decides_each_drain(tmp_path) -> None:
    res = scale.main(["--racks", "4", "--job-racks", "1", "--drains", "2", "--cpu-window", "2",
                      "--publishers", "1", "--workdir", str(tmp_path)])
    assert (res["nodes"], res["spares"], res["heartbeating_nodes"], res["jobs"]) == (72, 8, 64, 4)
    assert len(res["decision_latency_ms_all"]) == 2
    spares = {f"r{r:02d}t{t}" for r in range(4) for t in (16, 17)}
    assert len(set(res["spares_chosen"])) == 2 and set(res["spares_chosen"]) <= spares
    assert all(0 <= v < 5000 for v in res["decision_latency_ms_all"])
    assert res["decision_latency_ms"] <= res["decision_latency_ms_max"]
    assert res["drain_to_decision_ms"] >= res["decision_latency_ms"] - 1  # adds the wait for the Slurm poll
    assert 0 < res["torchpassd_cpu_percent"] < 200
