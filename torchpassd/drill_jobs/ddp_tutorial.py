"""A DDP training script as the PyTorch DDP tutorial writes it, with no TorchPass code at all: a model,
a DistributedSampler, init_process_group, DDP and a loop over epochs. Under ``sbatch --torchpass=transparent``
TorchPass moves its worker processes with criu (torchpassctl drill --mode planned-transparent).
Run: ``torchrun --nproc-per-node 2 ddp_tutorial.py --steps 100``. ``--log FILE`` writes one JSON line
per step (rank, step, loss as float.hex) and a final parameter hash, like ddp_train.py.
``--num-workers N`` loads batches in N DataLoader worker processes (``--worker-start fork|spawn``,
``--persistent-workers``), as nearly every training script does: a transparent move takes them along."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 256)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(self.drop(F.relu(self.fc1(x))))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100, help="stop after this many optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--log", help="append per-step JSON lines here")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--worker-start", choices=("fork", "spawn"), default="fork", help="their start method")
    ap.add_argument("--persistent-workers", action="store_true", help="keep them across epochs")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    workers = {"num_workers": args.num_workers, "multiprocessing_context": args.worker_start,
               "persistent_workers": args.persistent_workers} if args.num_workers else {}
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, **workers)
    log = open(args.log, "a", buffering=1) if args.log else None  # noqa: SIM115 - closed at the end

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if log:
                log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item().hex()}) + "\n")
            print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
            step += 1
            if step == args.steps:
                break
        epoch += 1
    if log:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        log.write(json.dumps({"rank": rank, "final": digest.hexdigest()[:16], "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
