"""bench ranks' arithmetic: each rank count's pause over the 1-rank pause of the same run, and a
run that measured nothing is reported as such, never as a number; the per-rank link model shapes
the ports the joiners listen on, one link for each local worker."""

from __future__ import annotations

from bench.ranks import markdown, rank_port_groups, summarise
from torchpassd.planned import WORMHOLE_PORT_BASE, joiner_port


def test_ratios_are_against_the_one_rank_pause_of_the_same_run() -> None:
    raw = {"state_mib": 256, "nodes": 2, "runs": {
        "1": {"pause_s": 2.0, "bytes": 10}, "2": {"pause_s": 2.4, "bytes": 20}, "4": {"pause_s": 3.1, "bytes": 40}}}
    res = summarise(raw)
    assert (res["ratio_2"], res["ratio_4"]) == (1.2, 1.55)
    assert res["pause_s_4"] == 3.1 and res["bytes_4"] == 40
    table = markdown(res)
    assert "| 1 | 2.0 | 10 | 1 (baseline) | - | - |" in table and "| 4 | 3.1 | 40 | 1.55 | - | - |" in table


def test_n_ranks_are_also_compared_with_one_rank_carrying_their_bytes() -> None:
    raw = {"state_mib": 256, "nodes": 2, "cpus": 2, "runs": {"1": {"pause_s": 0.4}, "4": {"pause_s": 1.0}},
           "same_bytes": {"4": {"pause_s": 1.25}}}
    res = summarise(raw)
    assert (res["ratio_4"], res["pause_s_one_rank_x4"], res["ratio_same_bytes_4"]) == (2.5, 1.25, 0.8)
    table = markdown(res)
    assert "2 CPUs" in table and "| 4 | 1.0 | None | 2.5 | 1.25 | 0.8 |" in table


def test_an_unmeasured_run_has_no_ratio_and_says_why() -> None:
    raw = {"state_mib": 4096, "nodes": 2, "runs": {
        "1": {"pause_s": 2.0}, "4": {"not_available": "skipped: does not fit in memory"}}}
    res = summarise(raw)
    assert res["ratio_4"] is None and res["pause_s_4"] is None
    assert res["note_4"] == "skipped: does not fit in memory"


def test_each_local_workers_joiner_port_is_on_a_link_of_its_own_in_every_generation() -> None:
    groups = rank_port_groups(4)
    assert len(groups) == 4 and not set(groups[0]) & set(groups[3])  # one link per local worker, none shared
    for gen in (1, 2, 17):  # a migration of generation gen listens on BASE + gen + 1
        assert all(joiner_port(WORMHOLE_PORT_BASE + gen + 1, i) in groups[i] for i in range(4))
    raw = {"state_mib": 256, "nodes": 2, "cpus": 2, "link_gbit_per_rank": 1.0, "runs": {"1": {"pause_s": 2.0}}}
    assert "a link of its own of 1 Gbit/s" in markdown(summarise(raw))
