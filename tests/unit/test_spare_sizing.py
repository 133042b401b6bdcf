"""Spare sizing (``torchpassctl goodput --advise-spares``) against a case computed by hand: 100
nodes failing 5 times per 1000 node-days, each away 48 h for repair, so on average
100 x 5/24000 x 48 = 1.0 node is away; P(a failure finds one of S spares) is the Poisson(1)
CDF at S-1. The journal's rates, counted once per lost node, replace the description's when it
saw enough node-hours; the CLI prints the advice, --json carries it, and the chart is written."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpassd import spare_sizing
from torchpassd.ctl import main
from torchpassd.goodput import Cluster
from torchpassd.journal import RUNNING, SUCCEEDED, Journal

ROOT = Path(__file__).resolve().parents[2]
SMALL = Cluster(nodes=100, gpus_per_node=4, usd_per_gpu_hour=2.0, failures_per_1000_node_days=5.0,
                checkpoint_interval_s=600, restart_overhead_s=300, repair_hours=48.0)
E = math.exp(-1)
POISSON_1_CDF = [E, 2 * E, 2.5 * E, (2.5 + 1 / 6) * E, (2.5 + 1 / 6 + 1 / 24) * E, (2.5 + 1 / 6 + 1 / 24 + 1 / 120) * E]


def test_the_chance_of_a_free_spare_is_the_poisson_cdf() -> None:
    assert spare_sizing.p_spare_free(1.0, 0) == 0.0
    for spares, want in enumerate(POISSON_1_CDF, start=1):
        assert spare_sizing.p_spare_free(1.0, spares) == pytest.approx(want, rel=1e-12)


def test_the_advice_for_the_hand_computed_cluster() -> None:
    adv = spare_sizing.advise(SMALL, None, 0.999, pause_s=2.0)
    assert adv["mean_away"] == pytest.approx(1.0)
    assert adv["recommended_spares"] == 6  # P(5) = 0.99634 < 0.999 <= P(6) = 0.99941
    assert adv["p_spare_free"] == pytest.approx(POISSON_1_CDF[5])
    assert spare_sizing.advise(SMALL, None, 0.99)["recommended_spares"] == 5  # P(4) = 0.98101 < 0.99
    assert "cluster description: 5 per 1000 node-days" in adv["rate_source"]


def test_goodput_weighs_idle_spares_against_failures_without_one() -> None:
    """182.5 failures a year stop the whole 400-GPU cluster for 600 s without a spare, 2 s with one."""
    curve = spare_sizing.advise(SMALL, None, 0.999, pause_s=2.0)["curve"]
    none, six = curve[0], curve[6]
    assert none["gpu_hours_lost_per_year"] == pytest.approx(182.5 * 400 * 600 / 3600)
    assert none["goodput"] == pytest.approx(1 - 182.5 * 400 * 600 / 3600 / (100 * 4 * 8760))
    lost6 = 182.5 * 400 * (POISSON_1_CDF[5] * 2 + (1 - POISSON_1_CDF[5]) * 600) / 3600
    assert six["gpu_hours_lost_per_year"] == pytest.approx(lost6)
    assert six["goodput"] == pytest.approx((100 * 4 * 8760 - lost6) / (106 * 4 * 8760))


def test_backfill_on_the_spares_makes_holding_them_cheaper() -> None:
    """With 90 % of the spares' time used by backfill jobs, holding S costs a tenth as much."""
    base = spare_sizing.advise(SMALL, None, 0.999, pause_s=2.0)["curve"][6]
    backfilled = Cluster(**{**SMALL.__dict__, "spare_backfill": 0.9})
    point = spare_sizing.advise(backfilled, None, 0.999, pause_s=2.0)["curve"][6]
    assert point["gpu_hours_held_per_year"] == pytest.approx(base["gpu_hours_held_per_year"] / 10)
    assert point["goodput"] > base["goodput"]


def test_the_journals_rates_count_each_lost_node_once_by_cause(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite") as j:
        j.upsert_job("7", user="u", mode="aware", state="RUNNING", gen=1, nodes=["n1", "n2", "n3", "n4"])
        for source, mode, reason in (("n1", "unplanned-aware", "node n1 died"), ("n2", "planned-aware", "maintenance"),
                                     ("n2", "planned-aware", "maintenance"),  # a retry: the same lost node
                                     ("n3", "planned-aware", "torchpass: GPU0 XID 79")):
            j.start_migration("7", mode=mode, source=source, reason=reason, gen=1)
        seen = spare_sizing.exposure_from(j, time.time() + 500 * 3600)  # 4 nodes for 500 hours
    assert seen.node_hours == pytest.approx(2000, rel=1e-3)
    assert seen.failures == {"node death": 1, "drain": 1, "GPU health": 1}
    adv = spare_sizing.advise(SMALL, seen, 0.999)
    assert adv["rate_per_node_hour"] == pytest.approx(3 / seen.node_hours)
    assert adv["rate_source"].startswith("journal: 3 node losses in 2,000 node-hours")
    short = spare_sizing.Exposure(10.0, {"drain": 1})
    assert "the journal saw 10.0 node-hours" in spare_sizing.advise(SMALL, short, 0.999)["rate_source"]


def test_a_target_that_is_no_probability_is_refused() -> None:
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="probability"):
            spare_sizing.advise(SMALL, None, bad)


def test_the_cli_advises_and_charts(tmp_path: Path) -> None:
    with Journal(tmp_path / "journal.sqlite") as j:
        j.upsert_job("11", user="u", mode="aware", state="RUNNING", gen=1, nodes=["n1", "n2"])
        mid = j.start_migration("11", mode="planned-aware", source="n1", reason="drain", gen=1)
        j.record_transition(mid, "resumed", RUNNING, {"pause_s": 1.5})
        j.record_transition(mid, "released", SUCCEEDED, {"pause_s": 1.5})
    args = ["goodput", "--cluster", str(ROOT / "contrib" / "goodput" / "cluster.toml"),
            "--journal", str(tmp_path / "journal.sqlite"), "--png", str(tmp_path / "g.png"), "--advise-spares"]
    res = CliRunner().invoke(main, [*args, "--json", "--target", "0.99"])
    assert res.exit_code == 0, res.output
    adv = json.loads(res.output)["spares"]
    s, m = adv["recommended_spares"], adv["mean_away"]
    assert m == pytest.approx(1152 * 5 / 24000 * 48)  # the example description: 1152 nodes, 48 h repair
    assert spare_sizing.p_spare_free(m, s - 1) < 0.99 <= spare_sizing.p_spare_free(m, s)
    assert Path(adv["chart"]) == tmp_path / "g-spares.png"
    assert Path(adv["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = CliRunner().invoke(main, args)  # the default target, 99.9 %
    want = next(n for n in range(100) if spare_sizing.p_spare_free(m, n) >= 0.999)
    assert text.exit_code == 0 and want > s
    assert f"hold {want} spares for a 99.90% chance that a failure finds one" in text.output, text.output
