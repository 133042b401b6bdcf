"""A sharded training script as users write them for torchrun: FSDP2 (``fully_shard``) over a
DeviceMesh, with ``torch.distributed.checkpoint`` state dicts (``get_state_dict``/``set_state_dict``),
made migratable by TorchPass with one call: ``torchpass.register(save=..., load=...)``.

``--mesh fsdp``: every rank holds one shard (1-D mesh over the job). ``--mesh hsdp``: shard within
a node, replicate across nodes (2-D mesh, torchrun's LOCAL_WORLD_SIZE ranks a node): each node holds
a whole replica, so a lost node can be rebuilt from another. ``--mesh tp``: tensor parallel within a
node, FSDP across nodes (2-D). Runs on gloo (CPU) and NCCL (``--backend nccl``, one GPU a rank).

Seeds are set per step and the data follows from the step, so a rank that takes over a saved state
continues exactly. ``--log FILE`` writes one JSON line per step (rank, step, loss as float.hex) and
the final parameters' hash; a progress line ``rank R step S loss L`` is printed every step.
Run: ``torchrun --nproc-per-node 2 fsdp_train.py --mesh fsdp --steps 50``."""

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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import torchpass


def make_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def shard(model: torch.nn.Sequential, kind: str, device: str) -> tuple[torch.nn.Module, DeviceMesh, int]:
    """The model sharded as ``kind`` says; returns it, its mesh, and this rank's data-parallel index
    (ranks with the same index see the same batch: tensor-parallel peers)."""
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if kind == "fsdp":
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("shard",))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh), mesh, dist.get_rank()
    mesh = init_device_mesh(device, (world // local, local),
                           mesh_dim_names=("replicate", "shard") if kind == "hsdp" else ("dp", "tp"))
    if kind == "hsdp":
        return fully_shard(model, mesh=mesh), mesh, dist.get_rank()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["dp"]), mesh, mesh["dp"].get_local_rank()


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():  # full_tensor() gathers: every rank calls it
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", choices=("fsdp", "hsdp", "tp"), default="fsdp")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--new-group-at", type=int, default=-1,
                    help="from this step on, also average the loss over a process group made at that step")
    ap.add_argument("--log", "--log-file", dest="log", help="append per-step JSON lines here")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    train(args)
    # the model, its mesh and the optimizer were freed when train() returned: their process groups
    # are destroyed now, while the interpreter is whole, not during its shutdown (where gloo's
    # threads can abort the process: "terminate called without an active exception")
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights everywhere; each rank keeps its shard
    model, _mesh, data_index = shard(make_model().to(device), args.mesh, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    progress = {"step": 0}

    def save() -> dict:
        model_state, optim_state = get_state_dict(model, opt)  # this rank's shards, as for a DCP checkpoint
        return {"model": model_state, "optim": optim_state, "step": progress["step"]}

    def load(state: dict) -> None:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        progress["step"] = state["step"]

    torchpass.register(save=save, load=load)

    log = open(args.log, "a", buffering=1) if args.log else None
    late: dist.ProcessGroup | None = None  # a group made mid-run (before or after a migration)
    while progress["step"] < args.steps:
        step = progress["step"]
        g = torch.Generator().manual_seed(100003 * step + data_index)
        x = torch.randn(args.batch_size, 64, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        value = loss.item().hex()
        if 0 <= args.new_group_at <= step:
            late = late or dist.new_group(list(range(dist.get_world_size())))
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=late)
            value += "/" + mean.item().hex()
        if log:
            log.write(json.dumps({"rank": rank, "step": step, "loss": value, "t": time.time()}) + "\n")
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        progress["step"] = step + 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
    final = param_hash(model)
    if log:
        log.write(json.dumps({"rank": rank, "final": final, "steps": progress["step"]}) + "\n")
        log.close()


if __name__ == "__main__":
    main()
