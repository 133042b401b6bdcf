"""The straggler policy: which node counts as slow (its ranks want ``ratio`` x the CPU a step of the
job's other nodes), for how many of its steps before its ranks are migrated, and at most once per
job per cooldown; the decision is asked of the orchestrator with a reason an operator can read,
counted in the metric and journaled. Hand-computed cases."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from torchpass_common import config
from torchpass_common.config import StragglerConfig
from torchpass_common.errors import ConfigError
from torchpassd.journal import Journal
from torchpassd.metrics import Metrics
from torchpassd.straggler import STALE_S, StragglerWatch, is_slow


def test_a_node_is_slow_against_the_median_of_the_others() -> None:
    # n3: 30 ms vs the others' median 10 ms -> 3x; n4 at 14 ms is 1.4x the median of (10, 10, 30) = 10 -> not slow
    busy = {"n1": 0.010, "n2": 0.010, "n3": 0.030, "n4": 0.014}
    assert [n for n in busy if is_slow(busy, n, 1.5)] == ["n3"]
    assert is_slow({"n1": 0.010, "n2": 0.016}, "n2", 1.5)  # two nodes: each against the other
    assert not is_slow({"n1": 0.010, "n2": 0.016}, "n1", 1.5)
    assert not is_slow({"n1": 0.010}, "n1", 1.5)  # nothing to compare with
    assert not is_slow({"n1": 0.0, "n2": 0.0, "n3": 0.5}, "n3", 1.5)  # idle peers: no median to compare with


def heartbeat(busy: dict[str, float], step: int) -> dict[str, dict]:
    """Per node a heartbeat body: two workers at ``step``, the node's slowest wanting ``busy``."""
    return {n: {"workers": [{"rank": 0, "step": step, "busy_s": b / 2}, {"rank": 1, "step": step + 1, "busy_s": b}]}
            for n, b in busy.items()}


def run(cfg: StragglerConfig, rounds: list[tuple[float, dict[str, float], int]], tmp_path: Path
        ) -> tuple[list, list, float, list]:
    """Feed ``rounds`` of (time, busy per node, step); -> (decisions, migrations asked, metric, journal)."""
    asked: list[tuple[str, str, str]] = []
    metrics = Metrics()

    async def main() -> list:
        with Journal(tmp_path / "journal.sqlite") as journal:
            watch = StragglerWatch(cfg, journal, migrate=lambda *a: asked.append(a), counter=metrics.stragglers_total)
            out = []
            for now, busy, step in rounds:
                for node, body in heartbeat(busy, step).items():
                    if (d := await watch.on_heartbeat("42", node, body, now=now)) is not None:
                        out.append(d)
            return out, [(e.event, e.detail) for e in journal.events(job_id="42")]
    decisions, events = asyncio.run(main())
    return decisions, asked, metrics.stragglers_total.value(), events


SLOW = {"n1": 0.010, "n2": 0.011, "n3": 0.040, "n4": 0.009}
EVEN = {"n1": 0.010, "n2": 0.011, "n3": 0.012, "n4": 0.009}


def test_a_node_slow_for_the_configured_steps_is_migrated_once_with_a_readable_reason(tmp_path: Path) -> None:
    cfg = StragglerConfig(enabled=True, ratio=1.5, steps=20, cooldown=600.0)
    rounds = [(float(i), SLOW, 100 + 5 * i) for i in range(12)]  # 5 steps a heartbeat
    decisions, asked, counted, events = run(cfg, rounds, tmp_path)
    (d,) = decisions  # at the heartbeat where n3 had been slow 20 of its steps; never again in the cooldown
    assert (d.node, d.steps) == ("n3", 20) and d.busy_s == 0.040 and d.median_s == 0.010
    assert asked == [("42", "n3", "straggler: the ranks on n3 wanted 40.0 ms of CPU a step, 4.0x the job's "
                                  "other nodes (10.0 ms), for 20 steps")]
    assert counted == 1
    assert events == [("straggler.decision", {"node": "n3", "busy_s": 0.04, "median_s": 0.01, "steps": 20,
                                              "reason": asked[0][2]})]


def test_a_node_that_recovers_starts_counting_again_and_the_cooldown_ends(tmp_path: Path) -> None:
    cfg = StragglerConfig(enabled=True, ratio=1.5, steps=20, cooldown=100.0)
    # slow for 15 steps, even once (reset), slow again: 20 more steps needed
    rounds = [(float(i), SLOW, 100 + 5 * i) for i in range(4)] + [(4.0, EVEN, 120)]
    rounds += [(5.0 + i, SLOW, 125 + 5 * i) for i in range(5)]
    decisions, *_ = run(cfg, rounds, tmp_path)
    assert [d.steps for d in decisions] == [20] and rounds[-1][2] - 125 == 20
    # after the cooldown the same job may migrate a straggler again (e.g. the spare is slow too)
    later = rounds + [(200.0 + i, SLOW, 400 + 5 * i) for i in range(5)]
    decisions, asked, counted, _ = run(cfg, later, tmp_path / "2")
    assert len(decisions) == 2 and counted == 2 and [a[1] for a in asked] == ["n3", "n3"]


def test_off_by_default_and_without_the_signal_nothing_happens(tmp_path: Path) -> None:
    rounds = [(float(i), SLOW, 100 + 5 * i) for i in range(30)]
    assert run(StragglerConfig(), rounds, tmp_path)[:3] == ([], [], 0)
    assert not StragglerConfig().enabled

    async def no_signal() -> object:
        with Journal(tmp_path / "j.sqlite") as journal:
            watch = StragglerWatch(StragglerConfig(enabled=True, steps=1), journal, migrate=lambda *a: None,
                                   counter=Metrics().stragglers_total)
            return await watch.on_heartbeat("42", "n3", {"workers": [{"rank": 2, "step": 9}]}, now=0.0)
    assert asyncio.run(no_signal()) is None  # an old launchpad: no busy_s, no judgement


def test_a_node_that_stopped_reporting_is_left_out_of_the_median(tmp_path: Path) -> None:
    # n4 (fast) stopped reporting: once stale, the median of n1, n2 alone still shows n3 slow
    cfg = StragglerConfig(enabled=True, ratio=1.5, steps=10)
    rounds = [(0.0, SLOW, 100)] + [(STALE_S + 1 + i, {k: v for k, v in SLOW.items() if k != "n4"}, 105 + 5 * i)
                                   for i in range(3)]
    decisions, *_ = run(cfg, rounds, tmp_path)
    assert [(d.node, d.median_s) for d in decisions] == [("n3", pytest.approx(0.0105))]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="straggler.ratio must be above 1"):
        config.parse("[straggler]\nratio = 1.0\n")
    with pytest.raises(ConfigError, match="straggler.steps must be at least 1"):
        config.parse("[straggler]\nsteps = 0\n")
