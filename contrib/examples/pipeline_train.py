"""A pipeline-parallel training script as users write them for torchrun: ``torch.distributed.pipelining``
stages (``PipelineStage``) run by a schedule (GPipe, 1F1B or interleaved 1F1B) over a DeviceMesh of
pipeline x data parallel, each stage's module under FSDP2 (``fully_shard``) replicated over its
data-parallel ranks (HSDP with one shard; torch's own DDP fails its bucket rebuild under a
schedule's micro-batches), with ``torch.distributed.checkpoint`` state dicts, made migratable by TorchPass with one call: ``torchpass.register(save=..., load=...)``.

``--layout across``: stage k on node k, its data-parallel replicas within the node (torchrun's
LOCAL_WORLD_SIZE ranks a node): a drained node takes its whole stage to the spare; a lost node
loses every replica of its stage. ``--layout within``: the stages within each node, data parallel
across nodes: each node holds a whole pipeline, so a lost node's stages are rebuilt from the other
node's replicas. ``--schedule interleaved`` puts two stages on every pipeline rank.

Seeds are set per step and the data follows from the step, so a rank that takes over a saved state
continues exactly. ``--log FILE`` writes one JSON line per step (rank, step, the last stage's
microbatch losses as float.hex, ``-`` on other ranks) and each rank's final parameters' hash; a
progress line ``rank R step S loss L`` is printed every step.
Run: ``torchrun --nnodes 2 --nproc-per-node 2 pipeline_train.py --schedule gpipe --steps 50``."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

import torchpass

WIDTH, CLASSES = 32, 10
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def make_blocks(count: int) -> list[torch.nn.Module]:
    """The whole model as ``count`` stage blocks, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                     for _ in range(count - 1)]
    return [*blocks, torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                                         torch.nn.Linear(WIDTH, CLASSES))]


def param_hash(modules: list[torch.nn.Module]) -> str:
    h = hashlib.sha256()
    for module in modules:
        for p in module.parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    ap.add_argument("--layout", choices=("across", "within"), default="across")
    ap.add_argument("--pp", type=int, default=0,
                    help="pipeline ranks (default: the nodes with --layout across, a node's ranks with within)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--log", "--log-file", dest="log", help="append per-step JSON lines here")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    train(args)
    gc.collect()  # the stages' process groups go now, while the interpreter is whole
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    pp_size = args.pp or (world // local if args.layout == "across" else local)
    if args.layout == "across":  # consecutive ranks (a node's) are one stage's replicas
        mesh = init_device_mesh(device.type, (pp_size, world // pp_size, 1), mesh_dim_names=("pp", "dp", "shard"))
    else:  # consecutive ranks (a node's) are the stages of one pipeline
        mesh = init_device_mesh(device.type, (world // pp_size, pp_size, 1), mesh_dim_names=("dp", "pp", "shard"))
    pp, dp = mesh["pp"], mesh["dp"]
    per_rank = 2 if args.schedule == "interleaved" else 1
    count = pp.size() * per_rank
    mine = [pp.get_local_rank() + k * pp.size() for k in range(per_rank)]  # this rank's stage indices
    blocks = make_blocks(count)
    models = [fully_shard(blocks[i].to(device), mesh=mesh["dp", "shard"]) for i in mine]
    held = torch.nn.ModuleList(models)  # this rank's stage modules, as one state dict
    stages = [PipelineStage(m, i, count, device, group=pp.get_group()) for m, i in zip(models, mine, strict=True)]
    loss_fn = torch.nn.functional.cross_entropy
    schedule_type = SCHEDULES[args.schedule]
    schedule = (schedule_type(stages, args.microbatches, loss_fn=loss_fn) if per_rank > 1
                else schedule_type(stages[0], args.microbatches, loss_fn=loss_fn))
    opt = torch.optim.Adam([p for m in models for p in m.parameters()], lr=1e-3)
    first, last = 0 in mine, count - 1 in mine
    progress = {"step": 0}

    def save() -> dict:
        model_state, optim_state = get_state_dict(held, opt)  # as for a DCP checkpoint
        return {"model": model_state, "optim": optim_state, "step": progress["step"]}

    def load(state: dict) -> None:
        set_state_dict(held, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        progress["step"] = state["step"]

    torchpass.register(save=save, load=load)

    log = open(args.log, "a", buffering=1) if args.log else None
    while progress["step"] < args.steps:
        step = progress["step"]
        g = torch.Generator().manual_seed(100003 * step + dp.get_local_rank())
        x = torch.randn(args.batch_size, WIDTH, generator=g).to(device)
        y = torch.randint(0, CLASSES, (args.batch_size,), generator=g).to(device)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        opt.step()
        value = ",".join(loss.item().hex() for loss in losses) if last else "-"
        if log:
            log.write(json.dumps({"rank": rank, "step": step, "loss": value, "t": time.time()}) + "\n")
        shown = f"{sum(loss.item() for loss in losses) / len(losses):.6f}" if last else "-"
        print(f"rank {rank} step {step} loss {shown}", flush=True)
        progress["step"] = step + 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if log:
        log.write(json.dumps({"rank": rank, "final": param_hash(models), "steps": progress["step"]}) + "\n")
        log.close()


if __name__ == "__main__":
    main()
