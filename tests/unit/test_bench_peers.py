"""bench peers' arithmetic: each peer's time lost over TorchPass's for the same fault, the two goals
(TorchPass loses least on every fault; only TorchPass stays bit-identical), and a system that
measured nothing is reported with why, never as a number and never as a met goal."""

from __future__ import annotations

from bench.peers import (
    NOT_MEASURED_RESTART,
    markdown,
    replacement_ready_s,
    restart_row,
    summarise,
    torchft_row,
    torchpass_row,
)


def _drill(pause: float, ok: bool = True) -> dict:
    return {"mode": "unplanned", "pause_s": pause, "detect_s": 0.5, "lost_steps": 0, "ok": ok, "bit_identical": ok,
            "job_state": "COMPLETED", "timeline": [{"phase": "detected", "seconds": 0.0},
                                                   {"phase": "interrupted", "seconds": 1.0},
                                                   {"phase": "resumed", "seconds": 1.5}]}


def test_peers_are_compared_with_torchpass_fault_by_fault() -> None:
    raw = {"faults": {
        "worker_kill": {"torchpass": torchpass_row(_drill(2.0), 0.2),
                        "checkpoint_restart": restart_row({"time_lost_s": 30.0, "lost_steps": 12}),
                        "torchft": torchft_row({"time_lost_s": 4.5, "steps_at_reduced_strength": 9,
                                                "bit_identical": False, "recovery_s": 2.9})},
        "node_kill": {"torchpass": torchpass_row(_drill(4.0), 0.2),
                      "checkpoint_restart": restart_row({"time_lost_s": 60.0}),
                      "torchft": torchft_row({"time_lost_s": 6.0, "steps_at_reduced_strength": 20,
                                              "bit_identical": False})}}}
    res = summarise(raw)
    wk = res["faults"]["worker_kill"]
    assert wk["torchpass"]["time_lost_s"] == 3.0  # detect 0.5 + phases up to the resume 2.5
    assert wk["peer_over_torchpass"] == {"checkpoint_restart": 10.0, "torchft": 1.5}
    assert res["torchpass_loses_least"] is True
    # checkpoint restart's bit-identity is not measured, so it cannot count against TorchPass
    assert res["only_torchpass_bit_identical"] is True
    table = markdown(res)
    assert "| worker_kill | torchft | 4.5 | 9 | False | 1.5 |" in table
    assert f"| node_kill | checkpoint_restart | 60.0 | 0 | {NOT_MEASURED_RESTART} | 20.0 |" in table


def test_a_peer_faster_than_torchpass_fails_the_goal() -> None:
    raw = {"faults": {"worker_kill": {"torchpass": torchpass_row(_drill(5.0), 0.2),
                                      "checkpoint_restart": restart_row({"time_lost_s": 30.0}),
                                      "torchft": torchft_row({"time_lost_s": 2.9, "bit_identical": True})}}}
    res = summarise(raw)
    assert res["torchpass_loses_least"] is False
    assert res["only_torchpass_bit_identical"] is False  # torchft stayed identical too


def test_an_unmeasured_system_is_reported_with_why_and_decides_no_goal() -> None:
    raw = {"faults": {"node_kill": {"torchpass": torchpass_row({"not_available": "the drill measured no pause"}, 0.2),
                                    "checkpoint_restart": restart_row({"error": "TorchPassError: timed out"}),
                                    "torchft": torchft_row({"error": "lighthouse did not start"})}}}
    res = summarise(raw)
    assert res["faults"]["node_kill"]["peer_over_torchpass"] == {"checkpoint_restart": None, "torchft": None}
    assert res["torchpass_loses_least"] is None and res["only_torchpass_bit_identical"] is None
    table = markdown(res)
    assert "| node_kill | torchpass | the drill measured no pause |" in table
    assert "| node_kill | torchft | lighthouse did not start |" in table


def test_torchfts_replacement_starts_when_torchpasss_was_ready() -> None:
    """A spare takes the same time to start for both: torchft's killed node is replaced as late as
    TorchPass's joiner was ready (detection plus the phases up to joiner_ready)."""
    rep = {"detect_s": 0.5, "timeline": [{"phase": "detected", "seconds": 0.0}, {"phase": "spare_chosen", "seconds": 0.2},
                                         {"phase": "joiner_ready", "seconds": 3.3}, {"phase": "resumed", "seconds": 1.0}]}
    assert replacement_ready_s(rep) == 4.0
    assert replacement_ready_s({"detect_s": 0.5, "timeline": []}) is None  # no replacement measured


def test_a_peer_whose_job_ended_unrecovered_lost_more_than_torchpass() -> None:
    """torchrun's restarts can fail (seen: gloo connectFullMesh refused three times) and the job ends
    FAILED: that job lost its run until a person resubmits it, more than any finite pause."""
    raw = {"faults": {"worker_kill": {"torchpass": torchpass_row(_drill(2.0), 0.2),
                                      "checkpoint_restart": restart_row({"job_ended": "FAILED", "time_lost_s": None}),
                                      "torchft": torchft_row({"time_lost_s": 5.0, "bit_identical": False})}}}
    res = summarise(raw)
    assert res["torchpass_loses_least"] is True
    assert "| worker_kill | checkpoint_restart | the job ended FAILED and did not come back" in markdown(res)


def test_a_peer_not_back_when_the_benchmark_stopped_waiting_lost_more_than_that() -> None:
    """Seen: torchrun's restarts failing over and over without the job ending; the benchmark gives
    up after its wait, which is then what the peer lost at least (a bound, not a figure)."""
    raw = {"faults": {"worker_kill": {"torchpass": torchpass_row(_drill(2.0), 0.2),
                                      "checkpoint_restart": restart_row({"not_back_within_s": 465.2,
                                                                         "time_lost_s": None}),
                                      "torchft": torchft_row({"time_lost_s": 5.0, "bit_identical": False})}}}
    res = summarise(raw)
    assert res["torchpass_loses_least"] is True
    assert "| worker_kill | checkpoint_restart | not back at the failed step 465 s after the fault" in markdown(res)
    raw["faults"]["worker_kill"]["checkpoint_restart"] = restart_row({"not_back_within_s": 2.0})  # below TorchPass's 3 s
    assert summarise(raw)["torchpass_loses_least"] is False
