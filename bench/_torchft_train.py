"""One torchft replica group (one process, group world size 1) training the drill job's model
(torchpassd/drill_jobs/ddp_train.py: its model, data, sampler partition, optimizer, scheduler and
per-step seeding), for bench/_torchft.py. A ``torchft.Manager`` (gloo, torchft's Optimizer wrapper,
the settings of torchft's train_ddp.py example) joins a quorum each step through the Lighthouse; a
restarted replica heals live from a peer through the state_dict/load_state_dict callbacks. The
gradients are averaged by ``Manager.allreduce`` after the backward pass, not by torchft's
DistributedDataParallel: in 0.2.0 its comm hook fails an assertion when a peer dies mid-allreduce
(the failed wait leaves the future unset), which kills the survivors too. The quorum is awaited before the forward pass, so the batch and the dropout seed follow
the step the quorum settled (a healing replica's jumps to its peers').
``--log FILE`` gets one JSON line when the Manager is up ({"replica", "ready", "t"}), one per step
attempt ({"replica", "step", "loss" as float.hex, "participants", "t"}; an attempt whose commit
fails is retried under the same step) and a last one ({"replica", "final": param_hash, "steps",
"t"}). ``--go FILE``: wait for FILE before the first step (the driver's start barrier)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
import torchft
from torch.distributed import TCPStore
from torch.utils.data import DistributedSampler

DRILL_JOB = Path(__file__).resolve().parent.parent / "torchpassd" / "drill_jobs" / "ddp_train.py"


def _drill_job() -> ModuleType:
    """The drill job loaded by path: it is a script (drill_jobs has no __init__), and importing it as
    torchpassd.drill_jobs.ddp_train would put torch under torchpassd for the import linter. Its
    ``import torchpass`` only installs a step counter, inert without torchpass.register."""
    spec = importlib.util.spec_from_file_location("_drill_ddp_train", DRILL_JOB)
    assert spec is not None and spec.loader is not None, DRILL_JOB
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True, help="replica groups of the job (data partition)")
    ap.add_argument("--lighthouse", required=True, help="http://host:port of the torchft Lighthouse")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--log", required=True, help="append JSON lines here")
    ap.add_argument("--go", help="wait for this file before the first step")
    args = ap.parse_args()
    job = _drill_job()
    rid = args.replica_id

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights in every replica (hence init_sync=False below)
    model = job.make_model()
    dataset = job.make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=args.replicas, rank=rid, shuffle=True, seed=0)
    batches_per_epoch = len(sampler) // args.batch_size

    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=20, gamma=0.9)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "opt": inner.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's store
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{rid}",
        rank=0, world_size=1, store_addr="localhost", store_port=store.port, hostname="localhost",
        lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=30), init_sync=False)
    opt = torchft.Optimizer(manager, inner)

    log = open(args.log, "a", buffering=1)
    log.write(json.dumps({"replica": rid, "ready": True, "t": time.time()}) + "\n")
    while args.go and not os.path.exists(args.go):
        time.sleep(0.01)
    order: list[int] = []
    order_epoch = -1
    while manager.current_step() < args.steps:
        opt.zero_grad()  # starts the quorum
        participants = manager.num_participants()  # waits for it (a healing replica's step moves here)
        step = manager.current_step()
        epoch, batch = divmod(step, batches_per_epoch)
        if epoch != order_epoch:
            sampler.set_epoch(epoch)
            order, order_epoch = list(sampler), epoch
        x, y = dataset[order[batch * args.batch_size:(batch + 1) * args.batch_size]]
        torch.manual_seed(100003 * step + rid)  # dropout depends only on (step, replica), as in the drill job
        loss = torch.nn.functional.cross_entropy(model(x), y)
        log.write(json.dumps({"replica": rid, "step": step, "loss": loss.item().hex(),
                              "participants": participants, "t": time.time()}) + "\n")
        loss.backward()
        for p in model.parameters():  # one at a time: after a failure the Manager skips the rest
            manager.allreduce(p.grad).wait()  # a failure is recorded: the step does not commit, it is retried
        opt.step()  # steps the optimizer only if the step commits
        if manager.current_step() > step:
            sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    log.write(json.dumps({"replica": rid, "final": job.param_hash(model), "steps": manager.current_step(),
                          "t": time.time()}) + "\n")
    log.close()
    manager.shutdown()


if __name__ == "__main__":
    main()
