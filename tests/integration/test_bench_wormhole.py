"""`python -m bench wormhole --json` end to end on loopback with a small state: one run measures
the raw-socket baseline and the wormhole for each stream count, and the ratio it prints is the
one those figures give (a benchmark that silently stopped measuring one side would fail here), as
is the CPU-bound ceiling it reports beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wormhole_benchmark_reports_both_sides_and_their_ratio() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "wormhole", "--json", "--gib", "0.05", "--reps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout)
    assert res["endpoints"] == "loopback" and res["bytes"] >= 0.05 * (1 << 30)
    for streams in (1, 2):
        raw, wormhole = res[f"raw_s{streams}_gbps"], res[f"inplace_s{streams}_gbps"]
        assert raw > 0 and wormhole > 0
        assert abs(res[f"ratio_s{streams}"] - wormhole / raw) < 0.01
        for kind in ("raw", "inplace"):  # each endpoint's CPU is reported, and they add up
            both = res[f"{kind}_s{streams}_cpu_s_per_gb"]
            sides = res[f"{kind}_s{streams}_send_cpu_s_per_gb"] + res[f"{kind}_s{streams}_recv_cpu_s_per_gb"]
            assert both > 0 and abs(both - sides) < 0.005
        # the CPU-bound ceiling: raw's CPU against raw's plus both checksums, all measured in this run
        raw_cpu = res[f"raw_s{streams}_cpu_s_per_gb"]
        checksums = 1 / res["checksum_gbps"] + 1 / res["checksum_hot_gbps"]
        assert 0 < res[f"cpu_bound_ceiling_s{streams}"] < 1
        assert abs(res[f"cpu_bound_ceiling_s{streams}"] - raw_cpu / (raw_cpu + checksums)) < 0.01
    assert res["ratio"] == res["ratio_s2"]  # the headline figures are the most streams measured
    assert res["cpu_bound_ceiling"] == res["cpu_bound_ceiling_s2"]
