"""A rank of a pipeline-parallel job (contrib/examples/pipeline_train.py: 2 stages x 2 data-parallel
replicas, FSDP2 per stage) is replaced by a new process over the real agent channel (the test
driver plays launchpad), for each schedule torch ships that users run: GPipe, 1F1B and interleaved
1F1B (two stages a rank). Every rank parks at the start of its schedule's step (a stage parked at
its next forward would leave the next stage waiting on its recv: the pause would never complete),
the joiner's fresh stages and the survivors' re-initialise together in generation 2, and losses and
every stage's final parameters are bit-identical to a plain gloo run. And the step() contract
alone, on a schedule class of the script's own: a pause runs at the start of the next step, once,
and a new generation clears the stages' initialisation."""

from __future__ import annotations

import pytest

from tests.support.agent_driver import ROOT, replace_rank

WORLD, STEPS = 4, 14
PIPELINE_EXAMPLE = ROOT / "contrib" / "examples" / "pipeline_train.py"
STAGE_REPLICAS = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}  # ranks 0, 1 hold stage 0; 2, 3 stage 1


@pytest.mark.slow
@pytest.mark.parametrize("schedule,leaving", [
    pytest.param("gpipe", 2, marks=pytest.mark.matrix),  # CI: the GPipe drain e2e (test_pipeline_jobs.py)
    ("1f1b", 3), ("interleaved", 1)])
def test_replacing_a_stage_rank_pauses_every_schedule_and_reforms_the_pipeline(drivers, schedule, leaving):
    replace_rank(drivers, PIPELINE_EXAMPLE, ["--schedule", schedule, "--layout", "across", "--pp", "2"],
                 world=WORLD, steps=STEPS, leaving=leaving, replicas=STAGE_REPLICAS, finals_alike=False)


def _schedule_type() -> type:
    """A schedule of the script's own (a subclass of torch's, defining step()), as a pipeline
    library may ship: it records what each step() found."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule  # noqa: PLC0415 - only this test loads it

    class OwnSchedule(_PipelineSchedule):
        def __init__(self) -> None:  # no stages: only the step() contract is under test
            self._stage_forward_initialized = self._stage_backward_initialized = True
            self.seen: list[tuple[bool, bool]] = []

        def _step_microbatches(self, *_: object, **__: object) -> None:
            raise NotImplementedError

        def step(self, *_: object, **__: object) -> None:
            self.seen.append((self._stage_forward_initialized, self._stage_backward_initialized))
            self._stage_forward_initialized = self._stage_backward_initialized = True  # as torch's init does

    return OwnSchedule


def test_a_pause_waits_for_the_next_step_and_a_new_generation_initialises_the_stages_again(monkeypatch) -> None:
    from torchpass import pipeline_schedules  # noqa: PLC0415

    generation = [1]
    monkeypatch.setattr(pipeline_schedules, "_generation", lambda: generation[0])
    schedule = _schedule_type()()
    schedule.step()  # before any pause: nothing wrapped, nothing changes
    parked: list[int] = []

    def park() -> None:  # where the agent parks; a re-form while parked starts generation 2
        parked.append(len(schedule.seen))
        generation[0] = 2

    handle = pipeline_schedules.before_next_step(park)
    assert handle is not None
    schedule.step()
    assert parked == [1]  # at the start of the step, before any of its work
    assert schedule.seen[-1] == (False, False)  # the stages initialise again in the new generation
    schedule.step()
    assert parked == [1] and schedule.seen[-1] == (True, True)  # once only; same generation: as it was
    handle.remove()  # a pause missed: nothing waits any more
    pipeline_schedules.before_next_step(lambda: parked.append(-1)).remove()
    schedule.step()
    assert parked == [1]
