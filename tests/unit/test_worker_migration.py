"""Real multi-process gloo training of torchpassd/drill_jobs/ddp_train.py (default DDP arguments) under
the torchpass bootstrap, driven over the real agent channel by a small test-only driver that plays
launchpad's side: pause at one step, re-form as generation 2, resume, and replacing one rank by a
new process. Every run must be bit-identical (losses and final parameters) to a plain gloo run."""

from __future__ import annotations

import json

import pytest

from tests.support.agent_driver import WAIT, Driver, Tap, handover_ends, read_logs
from torchpass_common import agent_channel as ac

STEPS = 40
WORLD = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on plain gloo (no bootstrap, no torchpass group). Step sleeps only
    change timing, so one reference serves every test."""
    d = Driver(tmp_path_factory.mktemp("reference"), WORLD, ["--steps", str(STEPS)])
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    try:
        for r in range(WORLD):
            d.start(r, logs[r], agent=False)
        d.wait_all()
    finally:
        d.close()
    losses, finals = read_logs(*logs)
    assert len(losses) == WORLD * STEPS and len(set(finals.values())) == 1
    return losses, finals


@pytest.mark.slow
@pytest.mark.parametrize("step_sleep,margin", [("0.02", 3), ("0", 12)], ids=["slow-steps", "fast-steps"])
def test_pause_reform_resume_is_bit_identical(drivers, reference, step_sleep, margin):
    ref_losses, ref_finals = reference
    d = drivers("pause", WORLD, ["--steps", str(STEPS), "--step-sleep", step_sleep])
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    for r in range(WORLD):
        d.start(r, logs[r])
    d.connect(WORLD)
    d.wait_steps(5)
    # each rank said once that every rank of DDP's group holds its state (unplanned: any can donate)
    assert [link.replicas for _, link in sorted(d.links.items())] == [[[0, 1]]] * WORLD
    at_step = d.pause_all(gen=2, margin=margin)
    d.reform_and_resume(gen=2)
    d.wait_all()
    losses, finals = read_logs(*logs)
    assert 5 < at_step < STEPS
    assert losses == ref_losses
    assert finals == ref_finals



@pytest.mark.slow
@pytest.mark.parametrize("leaving,transport,early", [(1, "tapped", False), (0, "wormhole", False), (1, "tapped", True)],
                         ids=["rank1-tapped", "rank0-wormhole", "rank1-tapped-at-step1"])
def test_replacing_a_rank_by_a_new_process_is_bit_identical(drivers, reference, leaving, transport, early):
    """``early``: hand over after step 1, before DDP rebuilt its buckets (the joiner then takes
    part in the live rebuild instead of replaying rank 0's layout). ``tapped``: the record passes
    through a wormhole hop of the test's (Tap), which looks inside it."""
    ref_losses, ref_finals = reference
    d = drivers("replace", WORLD, ["--steps", str(STEPS), "--step-sleep", "0.01"])
    tap = Tap() if transport == "tapped" else None
    dest, source = (tap.dest, tap.source) if tap else handover_ends()
    # The joiner is pre-warmed: it builds its model and DDP with local collectives, alone, and
    # says ready from register(), where it waits for the state. (Started first here so that the
    # short run cannot end before it is ready on a busy machine.)
    joiner_log = d.tmp / "joiner.jsonl"
    joiner = d.start(leaving, joiner_log, **{ac.ENV_JOIN: "1", ac.ENV_JOIN_SOURCE: json.dumps(source)})
    new = d.hellos.get(timeout=WAIT)
    assert new.hello["joining"] and new.hello["rank"] == leaving
    assert new.inbox.get(timeout=WAIT) == {"t": ac.READY}
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    for r in range(WORLD):
        d.start(r, logs[r])
    d.connect(WORLD)
    old = d.links[leaving]
    if early:
        at_step = d.pause_all(gen=2, margin=1)  # workers say hello before building their model
        assert at_step == 1
    else:
        d.wait_steps(3)
        at_step = d.pause_all(gen=2, margin=3)

    d.send(leaving, ac.SAVE, dest=dest)
    assert d.expect(leaving, ac.SAVED)["bytes"] > 0
    assert new.inbox.get(timeout=WAIT) == {"t": ac.JOINED, "step": at_step}
    d.send(leaving, ac.EXIT)
    assert d.procs[1 + leaving].wait(timeout=WAIT) == 0
    assert old.inbox.get(timeout=WAIT) is None  # the old worker closed its channel
    d.links[leaving] = new
    d.reform_and_resume(gen=2)
    d.wait_all()
    assert joiner.returncode == 0

    if tap:  # which DDP path the joiner took: replay rank 0's layout, or live rebuild
        handed = tap.record()["torchpass"]["ddp"]
        assert [layout["state"] for layout in handed] == ["pending" if early else "rebuilt"]
    losses, finals = read_logs(*logs, joiner_log)
    assert losses == ref_losses
    assert finals == ref_finals
    assert min(s for (r, s) in read_logs(joiner_log)[0]) == at_step  # the joiner continued at S
