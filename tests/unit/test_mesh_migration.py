"""A rank of an HSDP job (2-D DeviceMesh, fully_shard replicate x shard) that also all-reduces on a
new_group every step is replaced by a new process over the real agent channel (the test driver of
tests/support/agent_driver.py plays launchpad): the joiner builds its mesh and subgroups locally, loads
the leaving rank's shards, and is re-formed with the survivors as generation 2 (default group and
every subgroup). Losses, subgroup results and final parameters must be bit-identical to a plain
gloo run."""

from __future__ import annotations

import json

import pytest

from tests.support.agent_driver import (
    ROOT,
    SCRIPT_PRELUDE,
    WAIT,
    finished,
    handover_ends,
    read_logs,
    replace_rank,
    undisturbed_run,
)
from torchpass_common import agent_channel as ac

WORLD, STEPS = 4, 14
FSDP_EXAMPLE = ROOT / "contrib" / "examples" / "fsdp_train.py"


HSDP_SCRIPT = SCRIPT_PRELUDE + r'''
import os
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# as a script that sizes its mesh from the node it runs on would (the tests vary it on a joiner)
replicas = int(os.environ.get("TEST_MESH_REPLICAS", "2"))
mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
pair = dist.new_group([0, 1]), dist.new_group([2, 3])
mine = pair[0] if rank < 2 else pair[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
progress = {"step": 0}


def save():
    return {"shards": [p.to_local().detach().clone() for p in model.parameters()], "step": progress["step"]}


def load(state):
    with torch.no_grad():
        for p, shard in zip(model.parameters(), state["shards"], strict=True):
            p.to_local().copy_(shard)
    progress["step"] = state["step"]


torchpass.register(save=save, load=load)
log = open(args.log, "a", buffering=1)
while progress["step"] < args.steps:
    step = progress["step"]
    g = torch.Generator().manual_seed(1000 * step + rank)
    opt.zero_grad()
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    # After the optimizer step, as users log: a collective and the step variable belong to this
    # step on every rank (a pause parks before the next forward, the joiner starts there).
    t = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(t, group=mine)
    log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item().hex() + "/" + t.item().hex()}) + "\n")
    time.sleep(args.step_sleep)
    progress["step"] = step + 1
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.full_tensor().detach().numpy().tobytes())
log.write(json.dumps({"rank": rank, "final": h.hexdigest()[:16]}) + "\n")
log.close()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_replacing_a_rank_of_an_hsdp_job_reforms_every_subgroup_bit_identically(drivers, tmp_path):
    script = tmp_path / "hsdp.py"
    script.write_text(HSDP_SCRIPT)
    # replicate x shard on a 2 x 2 mesh: ranks 0 and 2 hold one shard, 1 and 3 the other
    replace_rank(drivers, script, [], world=WORLD, steps=STEPS, leaving=2, replicas={0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]})


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp", "tp"])
def test_replacing_a_rank_of_the_fsdp2_example_moves_its_dcp_shards_bit_identically(drivers, mesh):
    """contrib/examples/fsdp_train.py: save/load are DCP get_state_dict/set_state_dict of DTensor
    shards; they cross the wormhole as local shards and become DTensors on the joiner's mesh."""
    alone = {r: [r] for r in range(WORLD)}  # every rank its own shard: no replica (unplanned: requeue)
    replace_rank(drivers, FSDP_EXAMPLE, ["--mesh", mesh], world=WORLD, steps=STEPS, leaving=1, replicas=alone)


@pytest.mark.slow
def test_a_group_the_script_made_in_its_loop_before_the_move_is_adopted_by_the_joiner(drivers):
    """fsdp_train.py --new-group-at 1 makes a group at step 1 (before the pause): the joiner, which
    starts past that step, adopts it from the record; its own new_group of it returns that group."""
    alone = {r: [r] for r in range(WORLD)}
    replace_rank(drivers, FSDP_EXAMPLE, ["--mesh", "fsdp", "--new-group-at", "1"], world=WORLD, steps=STEPS,
                 leaving=3, replicas=alone)


@pytest.mark.slow
def test_a_joiner_that_builds_another_mesh_fails_the_migration_and_the_job_goes_on(drivers, tmp_path):
    """The joiner sizes its mesh 1 x 4 where the job runs 2 x 2: its own state, the wormhole's
    receive template, holds shards of another shape than the donor's, so the transfer is refused
    and both ends say why; the leaving rank, still parked, is re-formed with the others (as
    torchpassd's reform back does) and the run ends bit-identical to an undisturbed one."""
    script = tmp_path / "hsdp.py"
    script.write_text(HSDP_SCRIPT)
    ref_losses, ref_finals = undisturbed_run(drivers, script, [], world=WORLD, steps=STEPS)
    d = drivers("disagree", WORLD, ["--steps", str(STEPS), "--step-sleep", "0.05"], script)
    dest, source = handover_ends()
    joiner = d.start(2, d.tmp / "joiner.jsonl", **{ac.ENV_JOIN: "1", ac.ENV_JOIN_SOURCE: json.dumps(source),
                                                   "TEST_MESH_REPLICAS": "1"})
    new = d.hellos.get(timeout=WAIT)
    assert new.inbox.get(timeout=WAIT) == {"t": ac.READY}
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    workers = [d.start(r, logs[r]) for r in range(WORLD)]
    d.connect(WORLD)
    d.wait_steps(3)
    d.pause_all(gen=2, margin=3)
    d.send(2, ac.SAVE, dest=dest)
    refused = d.expect(2, ac.ERROR)  # the receiver told the sender why
    assert "receive template has float32[8, 8]" in refused["msg"], refused["msg"]
    error = new.inbox.get(timeout=WAIT)
    assert error["t"] == ac.ERROR, error
    assert "receiving the state failed" in error["msg"] and "receive template has" in error["msg"], error["msg"]
    assert joiner.wait(timeout=WAIT) != 0
    joiner_log = d.tmp / "joiner.jsonl"
    assert not joiner_log.exists() or not joiner_log.read_text()  # it never trained
    d.reform_and_resume(gen=3)
    finished(workers)
    assert read_logs(*logs) == (ref_losses, ref_finals)
