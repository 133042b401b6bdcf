"""Sharded state (DTensor) in a hand-over record: it travels as the local shard with its shape and
shard position, and the joiner gets DTensors back on its own mesh; a donor at another shard
position (not a replica of the joiner's state) or with another shard shape is refused with an
error naming both, never loaded. Runs in a child process (a one-rank gloo group of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torchpass import handover
from torchpass_common.errors import WorkerError

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
own = {"model": {"w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])}, "step": 0}
rec = handover.record({"model": {"w": w}, "step": 7}, 7, [])
sent = rec["user"]["model"]["w"]
assert not isinstance(sent, DTensor) and handover.has_local_shards(rec["user"]), sent
back = handover.sharded_like(rec["user"], own, rank=0)
assert isinstance(back["model"]["w"], DTensor) and back["model"]["w"].placements == (Shard(0),)
assert torch.equal(back["model"]["w"].full_tensor(), w.full_tensor()) and back["step"] == 7
for field, value, words in (("position", [1], "no replica"), ("shape", [8, 3], "shape [8, 3]")):
    bad = {"model": {"w": dict(sent, **{field: value})}, "step": 7}
    try:
        handover.sharded_like(bad, own, rank=0)
    except WorkerError as e:
        assert words in str(e), str(e)
        print("refused:", field)
    else:
        raise AssertionError(f"a donor with another {field} was accepted")
dist.destroy_process_group()
print("OK")
'''


def test_shards_cross_as_local_tensors_and_a_donor_at_another_position_is_refused(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["refused:", "position", "refused:", "shape", "OK"], res.stdout
