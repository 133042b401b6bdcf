"""TorchPassGroup on real gloo (two ranks as two threads of this process, one shared store):
every collective a script or DDP/FSDP uses is forwarded, the inner group is rebuilt for a new
generation, and a local (joining) group answers only what DDP's constructor and rebuild need."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchpass import steps
from torchpass.group import TorchPassGroup
from torchpass_common.errors import WorkerError

TIMEOUT = timedelta(seconds=30)


def on_both(fn):
    """Run fn(rank) for ranks 0 and 1 at once (collectives block until both take part)."""
    with ThreadPoolExecutor(2) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, r) for r in range(2)]]


@pytest.fixture
def groups():
    store = dist.HashStore()
    made = on_both(lambda r: TorchPassGroup("gloo", dist.PrefixStore("gen1/", store), r, 2, TIMEOUT,
                                            local=False))
    yield made, store
    for g in made:
        g.shutdown()


def test_collectives_are_forwarded_to_the_real_backend(groups):
    pgs, _ = groups

    def work(r: int) -> dict:
        pg, out = pgs[r], {}
        t = torch.tensor([r + 1.0])
        pg.allreduce([t]).wait()
        out["allreduce"] = t.item()
        b = torch.tensor([10.0 * (r + 1)])
        pg.broadcast([b]).wait()
        out["broadcast"] = b.item()
        gathered = [[torch.zeros(1), torch.zeros(1)]]
        pg.allgather(gathered, [torch.tensor([float(r)])]).wait()
        out["allgather"] = [x.item() for x in gathered[0]]
        flat = torch.zeros(2)
        pg.all_gather_single(flat, torch.tensor([float(r)])).wait()  # dist.all_gather_into_tensor
        out["all_gather_single"] = flat.tolist()
        a2a = torch.zeros(2)
        pg.alltoall_base(a2a, torch.tensor([10.0 * r, 10.0 * r + 1]), [], []).wait()
        out["alltoall_base"] = a2a.tolist()
        shard = torch.zeros(1)
        pg.reduce_scatter_single(shard, torch.tensor([1.0, 2.0]) * (r + 1)).wait()  # FSDP's reduce-scatter
        out["reduce_scatter_single"] = shard.item()
        pair = [torch.tensor([1.0]), torch.tensor([2.0])]
        pg.allreduce_coalesced(pair).wait()
        out["allreduce_coalesced"] = [x.item() for x in pair]
        pg.barrier().wait()
        msg = torch.tensor([7.0]) if r == 0 else torch.zeros(1)
        (pg.send([msg], 1, 0) if r == 0 else pg.recv([msg], 0, 0)).wait()
        out["p2p"] = msg.item()
        return out

    r0, r1 = on_both(work)
    assert r0.pop("alltoall_base") == [0.0, 10.0] and r1.pop("alltoall_base") == [1.0, 11.0]
    assert r0.pop("reduce_scatter_single") == 3.0 and r1.pop("reduce_scatter_single") == 6.0
    assert r0 == r1 == {"allreduce": 3.0, "broadcast": 10.0, "allgather": [0.0, 1.0],
                        "all_gather_single": [0.0, 1.0], "allreduce_coalesced": [2.0, 4.0], "p2p": 7.0}
    assert pgs[0].getBackendName() == "torchpass" and pgs[0].gen == 1


def test_reconfigure_builds_a_new_generation_in_the_same_object(groups):
    pgs, store = groups

    def reform(r: int) -> float:
        pgs[r].reconfigure(2, r, 2, store, "gen2/")
        t = torch.tensor([r + 1.0])
        pgs[r].allreduce([t]).wait()
        return t.item()

    assert on_both(reform) == [3.0, 3.0]
    assert [pg.gen for pg in pgs] == [2, 2]


def test_reconfigure_refuses_to_change_rank_or_world_size(groups):
    pgs, store = groups
    with pytest.raises(WorkerError, match="keeps its rank and world size"):
        pgs[0].reconfigure(2, 1, 2, store, "gen2/")
    with pytest.raises(WorkerError, match="rank 0 of 3"):
        pgs[0].reconfigure(2, 0, 3, store, "gen2/")
    assert pgs[0].gen == 1


def test_a_local_group_answers_ddp_construction_collectives_alone():
    pg = TorchPassGroup("gloo", None, 1, 2, TIMEOUT, local=True)
    assert pg.local and pg.gen == 0
    t = torch.tensor([5.0])
    pg.broadcast([t]).wait()
    assert t.item() == 5.0  # keeps its own values: load() overwrites them anyway
    outs = [[torch.zeros(2), torch.zeros(2)]]
    pg.allgather(outs, [torch.tensor([1.0, 2.0])]).wait()
    assert [o.tolist() for o in outs[0]] == [[1.0, 2.0], [1.0, 2.0]]
    pg.barrier().wait()

    indices, sizes = torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pg.answering_broadcasts([torch.tensor([2, 1, 0, 2], dtype=torch.int32),
                                  torch.tensor([2, 1], dtype=torch.int32)]):
        pg.broadcast([indices]).wait()
        pg.broadcast([sizes]).wait()
    assert indices.tolist() == [2, 1, 0, 2] and sizes.tolist() == [2, 1]

    with pytest.raises(WorkerError, match="not consumed"), pg.answering_broadcasts([torch.zeros(1)]):
        pass
    with pytest.raises(WorkerError, match="before torchpass.register"):
        pg.allreduce([t])


def test_a_collective_failed_by_a_lost_peer_is_found_and_a_good_one_is_not(groups):
    pgs, _ = groups
    on_both(lambda r: pgs[r].allreduce([torch.ones(4)]).wait())
    assert pgs[0].failed() is None, "completed collectives are no failure"
    pgs[1].abandon()  # rank 1 is lost: its connections close
    with pytest.raises(RuntimeError):
        pgs[0].allreduce([torch.ones(4)]).wait()
    assert isinstance(pgs[0].failed(), RuntimeError), "the bootstrap must see an interruption"
    pgs[0].abandon()
    assert pgs[0].failed() is not None, "abandoning keeps the failure for the interruption report"


def test_a_steps_collectives_are_not_kept_past_the_next_step(groups):
    pgs, _ = groups
    count = steps.current()
    try:
        inputs = [torch.ones(1 << 16), torch.ones(1 << 16)]
        first = weakref.ref(inputs[0])
        on_both(lambda r: pgs[r].allreduce([inputs[r]]).wait())
        steps.restore(count + 1)  # the optimizer stepped
        inputs.clear()
        assert first() is not None  # kept until the next step's first collective...
        on_both(lambda r: pgs[r].allreduce([torch.zeros(4)]).wait())
        assert first() is None, "...then released: the group must not hold a step's tensors longer"
    finally:
        steps.restore(count)


_RELEASE_RIGHT_AFTER_A_STEP = '''
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchpass.group import TorchPassGroup

rank, port, cycles = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
pg = TorchPassGroup("gloo", dist.PrefixStore("gen1/", store), rank, 2, timedelta(seconds=60), local=False)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)), process_group=pg)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 8)
for gen in range(2, 2 + cycles):
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    pg.release()  # what a worker does right after its step before criu moves it
    pg.reconfigure(gen, rank, 2, store, f"gen{gen}/")
print("cycles done", flush=True)
os._exit(0)
'''


def test_releasing_right_after_a_step_never_kills_the_worker(tmp_path) -> None:
    """Dropping the group right after a DDP step once killed workers: a done-callback that held the
    inner group ran, and was destroyed, on gloo's own thread, so the group's destructor joined that
    very thread (std::terminate, EDEADLK) within a few dozen cycles. Two workers must survive many
    release/re-form cycles."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "cycles.py"
    script.write_text(_RELEASE_RIGHT_AFTER_A_STEP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), "120"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and out.strip() == "cycles done", f"rank {rank}: rc {p.returncode}: {err[-1500:]}"
