"""A rank of a pipeline-parallel job (contrib/examples/pipeline_train.py: 2 stages x 2 data-parallel
replicas, FSDP2 per stage) is replaced by a new process over the real agent channel (the test
driver plays launchpad), for each schedule torch ships that users run: GPipe, 1F1B and interleaved
1F1B (two stages a rank). Every rank parks at the start of its schedule's step (a stage parked at
its next forward would leave the next stage waiting on its recv: the pause would never complete),
the joiner's fresh stages and the survivors' re-initialise together in generation 2, and losses and
every stage's final parameters are bit-identical to a plain gloo run."""

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
