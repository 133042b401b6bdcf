"""A DDP training script written the way users write them for torchrun, made migratable by
TorchPass with one call: ``torchpass.register(save=..., load=...)`` next to the checkpoint load.
Seeds are set per step and the data position follows from the step, so any rank can continue
from a saved state and a failed step replays exactly (unplanned recovery needs both; losses are
logged after the forward pass, so a rank killed mid-step has logged every step it began).
Run: ``torchrun --nproc-per-node 2 ddp_train.py --steps 100`` (or launchpad).
``--log FILE`` writes one JSON line per step (rank, step, loss as float.hex, wall time) and a final
hash. ``--checkpoint F --checkpoint-every N``: the checkpoint-restart way (rank 0 saves every N steps,
a restart resumes from F); ``--state-mib N`` adds N MiB of state per rank (benchmarks)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

import torchpass


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def make_dataset(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--checkpoint", help="resume from this checkpoint file if it exists")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="rank 0 saves --checkpoint every N steps")
    ap.add_argument("--state-mib", type=int, default=0, help="extra MiB of state per rank, carried by save/load")
    # --log-file: under real torchrun, whose parser calls "--log" ambiguous (--log-dir, --logs-specs)
    ap.add_argument("--log", "--log-file", dest="log", help="append per-step JSON lines here")
    ap.add_argument("--print-every", type=int, default=1, help="print a progress line every N steps (0: never)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.9)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    batches_per_epoch = len(sampler) // args.batch_size
    progress = {"step": 0}
    ballast = torch.full((args.state_mib << 18,), float(rank))  # float32: 2**18 per MiB

    def save() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": progress["step"], **({"ballast": ballast} if args.state_mib else {})}

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        progress["step"] = state["step"]  # the data position follows from the step
        if args.state_mib:
            ballast.copy_(state["ballast"])

    if args.checkpoint and os.path.exists(args.checkpoint):
        load(torch.load(args.checkpoint))
    torchpass.register(save=save, load=load)

    log = open(args.log, "a", buffering=1) if args.log else None
    order: list[int] = []
    started = time.perf_counter()
    while progress["step"] < args.steps:
        step = progress["step"]
        epoch, batch = divmod(step, batches_per_epoch)
        if batch == 0 or not order:
            sampler.set_epoch(epoch)
            order = list(sampler)
        idx = order[batch * args.batch_size:(batch + 1) * args.batch_size]
        x, y = dataset[idx]
        torch.manual_seed(100003 * step + rank)  # dropout depends only on (step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if log:  # before the gradient all-reduce: a rank killed mid-step has logged every step it began
            log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item().hex(), "t": time.time()}) + "\n")
        loss.backward()
        opt.step()
        sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        progress["step"] = step + 1
        if args.print_every and progress["step"] % args.print_every == 0:  # what users' tools parse
            print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        if args.checkpoint_every and rank == 0 and progress["step"] % args.checkpoint_every == 0:
            torch.save(save(), args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # a crash mid-save keeps the last one
    if log:
        log.write(json.dumps({"rank": rank, "final": param_hash(model), "steps": progress["step"],
                              "seconds": time.perf_counter() - started}) + "\n")
        log.close()
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
