"""A training script as the pytorch/examples DDP tutorial (multinode.py) writes one, with no TorchPass
code: a Trainer that loads its own snapshot file when one exists ("Loading snapshot"), saves it every
few epochs from rank 0, and prints one line per epoch and rank. ``--steps N`` trains N epochs (the
tutorial's total_epochs); ``--log FILE`` writes one JSON line per epoch (rank, step = epoch, the
epoch's last loss as float.hex) and a final parameter hash, as the e2e tests read them. The snapshot
lives beside the log (the tutorial's snapshot.pt)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, model: torch.nn.Module, loader: DataLoader, save_every: int, snapshot: Path,
                 step_sleep: float, log: Path | None) -> None:
        self.rank = dist.get_rank()
        self.model, self.loader, self.save_every, self.snapshot = model, loader, save_every, snapshot
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.epochs_run, self.step_sleep = 0, step_sleep
        if snapshot.exists():
            print(f"[rank {self.rank}] Loading snapshot", flush=True)
            state = torch.load(snapshot, weights_only=True)
            self.model.load_state_dict(state["MODEL_STATE"])
            self.opt.load_state_dict(state["OPT_STATE"])
            self.epochs_run = state["EPOCHS_RUN"]
            print(f"[rank {self.rank}] Resuming training from snapshot at epoch {self.epochs_run}", flush=True)
        self.model = DDP(self.model)
        self.log = open(log, "a", buffering=1) if log else None  # noqa: SIM115 - closed in train()

    def _run_epoch(self, epoch: int) -> float:
        self.loader.sampler.set_epoch(epoch)
        loss = torch.zeros(())
        for x, y in self.loader:
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
        print(f"[rank {self.rank}] Epoch {epoch} | Batchsize: {self.loader.batch_size} | Steps: {len(self.loader)}",
              flush=True)
        return loss.item()

    def _save_snapshot(self, epoch: int) -> None:
        state = {"MODEL_STATE": self.model.module.state_dict(), "OPT_STATE": self.opt.state_dict(),
                 "EPOCHS_RUN": epoch + 1}
        torch.save(state, self.snapshot)

    def train(self, total_epochs: int) -> None:
        for epoch in range(self.epochs_run, total_epochs):
            loss = self._run_epoch(epoch)
            time.sleep(self.step_sleep)
            if self.log:
                self.log.write(json.dumps({"rank": self.rank, "step": epoch, "loss": loss.hex()}) + "\n")
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
        if self.log:
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in self.model.parameters()))
            self.log.write(json.dumps({"rank": self.rank, "final": digest.hexdigest()[:16], "steps": total_epochs}) + "\n")
            self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50, help="total epochs")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--log")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(384, 32, generator=g), torch.randint(0, 4, (384,), generator=g))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True, seed=0))
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    snapshot = Path(args.log).with_suffix(".snapshot.pt") if args.log else Path(os.getcwd()) / "snapshot.pt"
    Trainer(model, loader, args.save_every, snapshot, args.step_sleep, Path(args.log) if args.log else None
            ).train(args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
