"""Goodput and benchmark arithmetic: the checkpoint-restart loss model, GPU-hours and dollars saved
from journaled migrations and projected per year, the cluster description, and the recovery
benchmark's ratios and baseline log analysis (synthetic inputs with known answers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import _restart, recovery
from torchpass_common.errors import ConfigError, TorchPassError
from torchpassd import goodput
from torchpassd.journal import RUNNING, SUCCEEDED, Journal


def test_checkpoint_restart_loss_is_overhead_plus_half_an_interval() -> None:
    assert goodput.checkpoint_restart_loss_s(120.0, 600.0) == 420.0
    assert goodput.checkpoint_restart_loss_s(0.0, 0.0) == 0.0
    with pytest.raises(ValueError):
        goodput.checkpoint_restart_loss_s(-1.0, 600.0)


def test_ratio_is_none_when_unknown_or_not_positive() -> None:
    assert goodput.ratio(420.0, 2.0) == 210.0
    assert goodput.ratio(None, 2.0) is None
    assert goodput.ratio(420.0, 0.0) is None


def _cluster(**kw: object) -> goodput.Cluster:
    base = {"nodes": 1000, "gpus_per_node": 4, "usd_per_gpu_hour": 2.0, "failures_per_1000_node_days": 2.0,
            "checkpoint_interval_s": 600.0, "restart_overhead_s": 300.0, "job_nodes": 100}
    return goodput.Cluster(**{**base, **kw})  # type: ignore[arg-type]


def test_report_counts_observed_migrations_and_projects_a_year() -> None:
    migs = [goodput.Migration("a", "1", "planned-aware", 0.0, 2.0, 10),
            goodput.Migration("b", "2", "planned-aware", 1.0, 4.0, 30)]
    rep = goodput.report(_cluster(), migs)
    observed, projected = rep["lines"]
    # restart loss 600 s per failure; jobs of 10 and 30 nodes x 4 GPUs
    assert observed["gpu_hours_checkpoint_restart"] == pytest.approx((40 + 120) * 600 / 3600)
    assert observed["gpu_hours_torchpass"] == pytest.approx((40 * 2 + 120 * 4) / 3600)
    assert observed["usd_saved"] == pytest.approx(observed["gpu_hours_saved"] * 2.0)
    assert rep["mean_pause_s"] == 3.0 and rep["loss_ratio"] == pytest.approx(200.0)
    # 1000 nodes x 365 days x 2/1000 = 730 failures, each stopping 100 nodes x 4 GPUs
    assert projected["failures"] == pytest.approx(730.0)
    assert projected["gpu_hours_saved"] == pytest.approx(730 * 400 * (600 - 3.0) / 3600)
    assert "checkpoint-restart loses 600 s" in goodput.table(rep)


def test_without_migrations_the_projection_uses_the_given_pause_or_is_left_out() -> None:
    assert len(goodput.report(_cluster(), [])["lines"]) == 1
    rep = goodput.report(_cluster(pause_s=5.0), [])
    assert rep["lines"][1]["gpu_hours_torchpass"] == pytest.approx(730 * 400 * 5.0 / 3600)


def test_cluster_description_toml_with_a_measured_restart(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text('{"baseline": {"restart_overhead_s": 87.5}}')
    desc = tmp_path / "c.toml"
    desc.write_text('nodes = 8\ngpus_per_node = 4\nusd_per_gpu_hour = 3.0\nfailures_per_1000_node_days = 4\n'
                    'restart_from = "recovery.json"\n')
    c = goodput.Cluster.load(desc)
    assert c.restart_overhead_s == 87.5 and c.restart_source.startswith("measured")
    assert c.restart_loss_s == 87.5 + 300.0
    desc.write_text('nodes = 8\ngpus_per_node = 4\nusd_per_gpu_hour = 3.0\nfailures_per_1000_node_days = 4\ncolour = 1\n')
    with pytest.raises(ConfigError, match="unknown key"):
        goodput.Cluster.load(desc)
    desc.write_text('nodes = 8\nusd_per_gpu_hour = 3.0\nfailures_per_1000_node_days = 4\n')
    with pytest.raises(ConfigError, match="required"):
        goodput.Cluster.load(desc)


def test_the_example_description_loads() -> None:
    c = goodput.Cluster.load(Path(__file__).resolve().parents[2] / "contrib" / "goodput" / "cluster.toml")
    assert c.nodes == 1152 and c.job_nodes == 128


def test_only_succeeded_migrations_with_a_pause_count(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite") as j:
        j.upsert_job("7", user="u", mode="aware", state="RUNNING", gen=1, nodes=["n1", "n2", "n3"])
        ok = j.start_migration("7", mode="planned-aware", source="n3", reason="drain", gen=1)
        j.record_transition(ok, "resumed", RUNNING, {"pause_s": 1.25})
        j.record_transition(ok, "released", SUCCEEDED, {"pause_s": 1.25})
        j.start_migration("7", mode="planned-aware", source="n2", reason="drain", gen=2)
        migs, statuses = goodput.migrations_from(j)
    assert [(m.id, m.pause_s, m.job_nodes) for m in migs] == [(ok, 1.25, 3)]
    assert statuses == {"succeeded": 1, "running": 1}


def test_baseline_analysis_finds_the_restart_and_splits_the_loss() -> None:
    # rank 0: steps 0..37 one per second from t=0; killed at t=37.5; the restart begins again at the
    # checkpoint (step 25) at t=100 and steps once per second
    lines = [(s, float(s)) for s in range(38)] + [(s, 100.0 + s - 25) for s in range(25, 40)]
    got = _restart.analyse(lines, killed_at=37.5)
    assert (got["failed_step"], got["resumed_from_step"], got["lost_steps"]) == (37, 25, 12)
    assert got["step_s"] == 1.0
    assert got["time_lost_s"] == pytest.approx(112 - 37.5)
    assert got["restart_overhead_s"] == pytest.approx(99 - 37.5)
    assert got["recompute_s"] == pytest.approx(13.0)
    with pytest.raises(TorchPassError):
        _restart.analyse(lines[:45], killed_at=37.5)  # restarted but not back at step 37 yet


def test_recovery_summary_ratios_and_goals() -> None:
    raw = {"baseline": {"restart_overhead_s": 60.0, "time_lost_s": 70.0}, "link_gbps": 2.0,
           "modes": {"planned-aware": {"pause_s": 1.8}, "unplanned": {"not_available": "not available: x"}},
           "sizes": {"1 GiB": {"pause_s": 0.9, "bytes": 2**30}, "2 GiB": {"pause_s": 1.6, "bytes": 2**31}, "4 GiB": {"not_available": "skipped: memory"}},
           "overhead": {"ratio": 1.004}, "scale": {"decision_latency_ms": 42.0, "nodes": 1152}}
    res = recovery.summarise(raw, interval_s=600.0)
    assert res["checkpoint_restart_model"]["expected_loss_s"] == 360.0
    assert res["restart_over_pause"] == {"planned-aware": 200.0, "unplanned": "not available: x"}
    assert res["restart_over_pause_measured"]["planned-aware"] == pytest.approx(38.89)
    assert res["pause_over_floor"]["1 GiB"] == pytest.approx(0.9 / (2**30 / 2e9), abs=0.01)
    assert raw["sizes"]["1 GiB"]["within_goal"] is True  # 0.9 <= 1.2 x 0.537 + 0.3
    assert raw["sizes"]["2 GiB"]["within_goal"] is False  # 1.6 > 1.2 x 1.074 + 0.3
    assert res["pause_over_floor"]["4 GiB"] == "skipped: memory"
    assert (res["overhead_ratio"], res["decision_latency_ms"]) == (1.004, 42.0)
    table = recovery.markdown({**res, "raw": raw})
    assert "restart_over_pause planned-aware | 200" in table and "1152 nodes" in table


def test_state_sizes_that_do_not_fit_are_skipped_with_the_reason() -> None:
    assert recovery.size_fits(256, 3, 16 * 2**30) == ""
    assert "skipped" in recovery.size_fits(4096, 3, 16 * 2**30)
    # 2 ranks + the joiner (which receives into its own tensors) at 4 GiB: 12 GiB of 70% of 20 GiB
    assert recovery.size_fits(4096, 2, 20 * 2**30) == ""
    assert recovery.time_lost({"pause_s": 2.0, "lost_steps": 1}, 0.25) == 2.25
    assert recovery.time_lost({"pause_s": None}, 0.25) is None
    # unplanned: from the kill: detection, then every phase up to the resume
    timeline = [{"phase": "detected", "seconds": 0.0}, {"phase": "spare_chosen", "seconds": 0.5},
                {"phase": "resumed", "seconds": 3.0}, {"phase": "released", "seconds": 9.0}]
    rep = {"mode": "unplanned", "pause_s": 3.4, "detect_s": 0.2, "lost_steps": 0, "timeline": timeline}
    assert recovery.time_lost(rep, 0.25) == pytest.approx(3.7)


def test_recovery_plot_and_outputs_from_a_saved_result(tmp_path: Path) -> None:
    raw = {"baseline": {"restart_overhead_s": 60.0, "time_lost_s": 70.0}, "link_gbps": 1.0,
           "modes": {"planned-aware": {"pause_s": 1.0}},
           "sizes": {"model only": {"pause_s": 1.0, "bytes": 3 << 20}, "0.25 GiB": {"pause_s": 1.6, "bytes": 2**28}},
           "overhead": {"ratio": 1.0}, "scale": {"decision_latency_ms": 10.0, "nodes": 72}}
    saved = tmp_path / "in.json"
    saved.write_text(__import__("json").dumps({"raw": raw}))
    res = recovery.main(["--from-json", str(saved), "--outdir", str(tmp_path / "out")])
    assert Path(res["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert "pause_over_floor 0.25 GiB" in Path(res["markdown"]).read_text()
    assert res["restart_over_pause"]["planned-aware"] == 360.0


def test_unplanned_time_lost_is_reported_for_every_victim_position_beside_the_collective_timeout() -> None:
    timeline = [{"phase": "detected", "seconds": 0.0}, {"phase": "spare_chosen", "seconds": 0.5},
                {"phase": "resumed", "seconds": 2.0}]
    raw = {"baseline": {"step_s": 0.2}, "collective_timeout_s": 30.0, "positions": {
        "1": {"mode": "unplanned-aware", "pause_s": 3.0, "detect_s": 0.5, "timeline": timeline, "lost_steps": 0},
        "2": {"not_available": "not available: the unplanned drill measured no pause (x)"}}}
    res = recovery.summarise(raw)
    assert res["unplanned_by_position"]["1"] == {"time_lost_s": 3.0, "detect_s": 0.5, "note": None}  # 0.5 + 0.5 + 2
    assert res["unplanned_by_position"]["2"]["time_lost_s"] is None
    table = recovery.markdown({**res, "raw": raw})
    assert "node 1 of the job killed, a spare from the pool takes its ranks | 3 s (detected in 0.5 s; " \
           "collective timeout 30 s)" in table
    assert "node 2 of the job killed, a spare from the pool takes its ranks | not available" in table
    hot = recovery.markdown({**res, "raw": {**raw, "positions_hot_spares": 1}})  # bench recovery's default
    assert "node 1 of the job killed, the job's hot spare (--torchpass-spares=1) takes its ranks | 3 s" in hot


def test_a_state_size_measured_several_times_reports_the_median_drill_and_every_sample() -> None:
    reports = [{"pause_s": 1.9, "job_id": "a"}, {"pause_s": None, "error": "x"}, {"pause_s": 1.1, "job_id": "b"},
               {"pause_s": 1.4, "job_id": "c"}]
    pick = recovery.median_sample(reports)
    assert (pick["job_id"], pick["pause_s"], pick["failed_samples"]) == ("c", 1.4, 1)
    assert pick["samples_pause_s"] == [1.9, None, 1.1, 1.4]
    assert recovery.median_sample([{"pause_s": None, "error": "x"}])["error"] == "x"  # all failed: says why
    raw = {"link_gbps": 2.0, "sizes": {"1 GiB": {**pick, "bytes": 2**30}}}
    assert "median of 4: pause 1.40 s" in recovery.markdown({**recovery.summarise(raw), "raw": raw})


def test_a_state_size_is_judged_against_the_floor_measured_next_to_its_drills() -> None:
    # the run-wide link said 1 GB/s; right before the 1 GiB drills it moved 2 GB/s: that floor counts
    raw = {"link_gbps": 1.0, "sizes": {"1 GiB": {"pause_s": 1.6, "bytes": 2 * 10**9, "link_gbps": 2.0},
                                       "model only": {"pause_s": 0.3, "bytes": 10**8}}}
    res = recovery.summarise(raw)
    # 1.6 s > 1.2 x 1.0 + 0.3 (against the run-wide floor of 2 s it would have passed)
    assert raw["sizes"]["1 GiB"]["floor_s"] == 1.0 and not raw["sizes"]["1 GiB"]["within_goal"]
    assert raw["sizes"]["model only"]["floor_s"] == 0.1  # no floor of its own: the run-wide one
    assert res["pause_over_floor"] == {"1 GiB": 1.6, "model only": 3.0}
    assert "pause 1.60 s, floor 1.00 s at 2.00 GB/s" in recovery.markdown({**res, "raw": raw})
