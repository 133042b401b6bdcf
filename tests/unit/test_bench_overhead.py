"""bench/overhead.py's summary: the ratio pairs each launchpad run with the torchrun run of its
round, so a round disturbed by other load does not count against one launcher only."""

from bench.overhead import summarise


def _runs(ms: list[float], agent: float) -> list[dict[str, float]]:
    return [{"step_s": v / 1e3, "launcher_cpu": agent} for v in ms]


def test_a_round_slowed_for_both_launchers_keeps_the_ratio() -> None:
    # the load drifts from round to round; within a round both launchers see the same
    torchrun = _runs([20.0, 40.0, 30.0], agent=0.002)
    launchpad = _runs([20.2, 40.4, 30.3], agent=0.005)
    res = summarise(torchrun, launchpad)
    assert res["ratio"] == 1.01
    assert res["ratio_range"] == [1.01, 1.01]
    assert (res["torchrun_agent_cpu_pct"], res["launchpad_agent_cpu_pct"]) == (0.2, 0.5)


def test_a_disturbed_round_does_not_move_the_ratio() -> None:
    torchrun = _runs([20.0, 20.0, 20.0, 20.0, 20.0], agent=0.0)
    launchpad = _runs([20.0, 30.0, 20.0, 20.0, 20.0], agent=0.0)  # one launchpad run hit by load
    res = summarise(torchrun, launchpad)
    assert res["ratio"] == 1.0
    assert res["ratio_range"] == [1.0, 1.5]  # the spread is reported, not hidden
