"""bench wormhole's verdict: which goal applies to the measured path (a shaped link or the CPU)
and whether the ratio meets it, and the table it writes."""

from __future__ import annotations

from bench import wormhole


def result(**kw: object) -> dict:
    return {"endpoints": "loopback", "link_gbit": None, "streams": 2, "bytes": 2**31, "raw_s2_gbps": 2.0,
            "inplace_s2_gbps": 1.6, "ratio": 0.8, "cpu_bound_ceiling": 0.85, **kw}


def test_a_cpu_bound_path_is_judged_against_the_checksum_ceiling() -> None:
    res = result()
    assert wormhole.verdict(res) == {"goal": "ratio >= 0.9 x cpu_bound_ceiling 0.85 = 0.765 (CPU-bound)",
                                     "goal_met": True}
    assert wormhole.verdict(result(ratio=0.7))["goal_met"] is False
    assert wormhole.path_name(res) == "loopback"


def test_a_shaped_link_must_carry_the_raw_throughput() -> None:
    res = result(endpoints="devcluster n1->n2", link_gbit=8.0, ratio=0.94)
    assert wormhole.verdict(res)["goal_met"] is False  # the ceiling does not excuse a link-bound path
    assert wormhole.verdict({**res, "ratio": 0.99})["goal_met"] is True
    assert wormhole.path_name(res) == "link-8gbit"


def test_the_table_names_the_path_the_ratio_and_the_verdict() -> None:
    res = result()
    table = wormhole.markdown({**res, **wormhole.verdict(res)})
    assert "loopback" in table and "| 2.0 GB/s | 1.6 GB/s | 0.8 | 0.85 |" in table and "| yes |" in table
