"""Where a paused rank parks when the script has no DDP: before the next forward of any module (an
FSDP2, tensor-parallel or plain module), so that what the script does after opt.step() belongs to
the paused step (tests/unit/test_mesh_migration.py shows it for HSDP); and a script whose steps
run no module forward at all: the first pause is missed (the step ran without the forward the rank
waited for), the next parks at the step boundary, and training stays bit-identical."""

from __future__ import annotations

import pytest

from tests.support.agent_driver import SCRIPT_PRELUDE, read_logs
from torchpass_common import agent_channel as ac

WORLD, STEPS = 2, 30

# Hand-written data parallelism on a bare tensor: no nn.Module, no DDP, a gradient all-reduce and
# a loss all-reduce after the optimizer step.
FORWARDLESS = SCRIPT_PRELUDE + r'''
w = torch.nn.Parameter(torch.ones(16))
opt = torch.optim.SGD([w], lr=0.05, momentum=0.9)
progress = {"step": 0}


def load(state):
    with torch.no_grad():
        w.copy_(state["w"])
    opt.load_state_dict(state["opt"])
    progress["step"] = state["step"]


torchpass.register(save=lambda: {"w": w.detach().clone(), "opt": opt.state_dict(), "step": progress["step"]},
                   load=load)
log = open(args.log, "a", buffering=1)
while progress["step"] < args.steps:
    step = progress["step"]
    target = torch.randn(16, generator=torch.Generator().manual_seed(100 * step + rank))
    opt.zero_grad()
    loss = ((w - target) ** 2).sum()
    loss.backward()
    dist.all_reduce(w.grad)
    w.grad /= world
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item().hex() + "/" + mean.item().hex()}) + "\n")
    progress["step"] = step + 1
    time.sleep(args.step_sleep)
log.write(json.dumps({"rank": rank, "final": hashlib.sha256(w.detach().numpy().tobytes()).hexdigest()[:16]}) + "\n")
log.close()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_a_script_without_module_forwards_misses_one_pause_then_parks_at_the_step(drivers, tmp_path):
    script = tmp_path / "forwardless.py"
    script.write_text(FORWARDLESS)
    ref = drivers("reference", WORLD, ["--steps", str(STEPS)], script)
    ref_logs = [ref.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    for r in range(WORLD):
        ref.start(r, ref_logs[r], agent=False)
    ref.wait_all()

    d = drivers("paused", WORLD, ["--steps", str(STEPS), "--step-sleep", "0.05"], script)
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(WORLD)]
    for r in range(WORLD):
        d.start(r, logs[r])
    d.connect(WORLD)
    d.wait_steps(2)
    first = max(link.step for link in d.links.values()) + 3
    for r in range(WORLD):
        d.send(r, ac.PAUSE, gen=2, at_step=first)
    replies = [d.links[r].inbox.get(timeout=60) for r in range(WORLD)]
    # no module forward came after step `first`: each rank says so at the next step boundary
    assert [(m["t"], m["step"]) for m in replies] == [(ac.PAUSE_MISSED, first + 1)] * WORLD, replies
    at_step = d.pause_all(gen=2, margin=3)  # learned: this one parks at the step boundary
    assert first + 1 < at_step < STEPS
    d.reform_and_resume(gen=2)
    d.wait_all()
    assert read_logs(*logs) == read_logs(*ref_logs)
