"""A 3-D DeviceMesh (replicate x shard x tensor parallel, torchtitan's HSDP+TP shape), split_group
(of the default group and of a subgroup), new_group with an explicit backend, and the errors for
backends a migration cannot re-form, on eight real worker processes on gloo. With TorchPass the
default group (and every subgroup) is re-formed twice between phases; plain torch, never
re-formed, is the reference. On CPU torch's own split_group needs an NCCL communicator and raises,
so under TorchPass each split is a new_group of its members and its results are checked against
the sums they must be."""

from __future__ import annotations

import pytest

from tests.support.group_workers import REFORM, plain_and_reformed

WORLD = 8

WORKLOAD = r'''
import hashlib, json, os
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}


def put(key, value):
    assert key not in out, key
    out[key] = value


def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
put("dims", {name: sorted(dist.get_process_group_ranks(mesh.get_group(name))) for name in mesh.mesh_dim_names})


def train(tag, first_step):
    losses = []
    for step in range(first_step, first_step + 2):
        # the same batch on the ranks of one tensor-parallel pair, as TP needs
        g = torch.Generator().manual_seed(1000 * step + rank // 2)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.full_tensor().detach().contiguous().numpy().tobytes())
    put(f"{tag}.losses", losses)
    put(f"{tag}.params", h.hexdigest()[:16])


def total(tag, label, group):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    put(f"{tag}.{label}", [t.item(), funcol.all_reduce(torch.tensor([float(rank + 1)]), "sum", group).item(),
                           sorted(dist.get_process_group_ranks(group))])


def groups(tag):
    """Groups a phase makes: new_group with a backend named, and (TorchPass only) splits."""
    made = {"gloo_named": dist.new_group(list(range(world)), backend="gloo"),
            "cpu_gloo": dist.new_group([r for r in range(world) if r % 2 == 0], backend="cpu:gloo")}
    if os.environ.get("MESH_TEST_REFORM") == "1":
        halves = dist.split_group(split_ranks=[[0, 1, 2, 3], [4, 5, 6, 7]])
        made["split_halves"] = halves
        # a split of a subgroup: its group ranks 0, 1 and 2, 3
        made["split_quarters"] = dist.split_group(parent_pg=halves, split_ranks=[[0, 1], [2, 3]])
        # ranks outside every split get None
        made["split_only_low"] = dist.split_group(split_ranks=[[0, 1, 2]])
    # a rank outside a group gets None (split_group) or NON_GROUP_MEMBER (new_group)
    put(f"{tag}.not_member", sorted(k for k, v in made.items() if not isinstance(v, dist.ProcessGroup)))
    return {k: v for k, v in made.items() if isinstance(v, dist.ProcessGroup)}


def phase(tag, earlier):
    for origin, made in (("now", groups(tag)), *earlier):
        for label, group in made.items():
            total(tag, f"{origin}.{label}", group)
    return made


def bad_backends(tag):
    """Backends a migration cannot re-form: every rank gets the error at the call."""
    put(f"{tag}.mpi", error_of(lambda: dist.new_group(list(range(world)), backend="mpi")))
    put(f"{tag}.nccl", error_of(lambda: dist.new_group(list(range(world)), backend="nccl")))
''' + REFORM + r'''
train("gen1", 0)
first = phase("gen1", [])
reform(2)
train("gen2", 2)
second = phase("gen2", [("made1", first)])
reform(3)
train("gen3", 4)
phase("gen3", [("made1", first), ("made2", second)])
bad_backends("gen3")
with open(os.path.join(os.environ["MESH_RESULT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "out": out}, f, sort_keys=True)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return plain_and_reformed(tmp_path_factory, WORKLOAD, WORLD)


def _pick(rec: dict, part: str) -> dict:
    return {k: v for k, v in rec["out"].items() if part in k}


@pytest.mark.slow
def test_3d_mesh_hsdp_with_tensor_parallel_trains_bit_identically_across_reformations(runs):
    plain, reformed = runs
    for r in range(WORLD):
        assert reformed[r]["out"]["reformed2"] and reformed[r]["out"]["reformed3"]
        assert reformed[r]["out"]["dims"] == plain[r]["out"]["dims"] == {
            "dp_replicate": [r % 4, r % 4 + 4], "dp_shard": sorted([r, r ^ 2]), "tp": sorted([r, r ^ 1])}
        got = {k: v for k, v in reformed[r]["out"].items() if k.endswith((".losses", ".params"))}
        assert got == {k: v for k, v in plain[r]["out"].items() if k.endswith((".losses", ".params"))}
        assert len(got) == 6
    assert len({reformed[r]["out"]["gen3.params"] for r in range(WORLD)}) == 1


@pytest.mark.slow
def test_new_group_with_a_named_backend_is_that_backend_and_survives_reformations(runs):
    plain, reformed = runs
    for r in range(WORLD):
        got = _pick(reformed[r], "gloo")
        assert got == _pick(plain[r], "gloo")
        evens = [0, 2, 4, 6]
        for gen, origins in (("gen1", ["now"]), ("gen2", ["now", "made1"]), ("gen3", ["now", "made1", "made2"])):
            for origin in origins:
                assert got[f"{gen}.{origin}.gloo_named"] == [36.0, 36.0, list(range(8))]
                if r in evens:
                    assert got[f"{gen}.{origin}.cpu_gloo"] == [16.0, 16.0, evens]


@pytest.mark.slow
def test_split_group_of_the_default_group_and_of_a_subgroup_survives_reformations(runs):
    _, reformed = runs
    for r in range(WORLD):
        out = reformed[r]["out"]
        half = list(range(4)) if r < 4 else list(range(4, 8))
        quarter = [r - r % 2, r - r % 2 + 1]
        for gen, origins in (("gen1", ["now"]), ("gen2", ["now", "made1"]), ("gen3", ["now", "made1", "made2"])):
            assert out[f"{gen}.not_member"] == sorted((["cpu_gloo"] if r % 2 else []) +
                                                      ([] if r < 3 else ["split_only_low"]))
            for origin in origins:
                assert out[f"{gen}.{origin}.split_halves"] == [float(sum(m + 1 for m in half))] * 2 + [half]
                assert out[f"{gen}.{origin}.split_quarters"] == [float(sum(m + 1 for m in quarter))] * 2 + [quarter]
                if r < 3:
                    assert out[f"{gen}.{origin}.split_only_low"] == [6.0, 6.0, [0, 1, 2]]


@pytest.mark.slow
def test_a_backend_a_migration_cannot_reform_is_refused_at_new_group_naming_it(runs):
    plain, reformed = runs
    for r in range(WORLD):
        out = reformed[r]["out"]
        assert "new_group(backend='mpi')" in out["gen3.mpi"] and "re-forms only gloo and nccl" in out["gen3.mpi"]
        assert "new_group(backend='nccl')" in out["gen3.nccl"] and "no NCCL" in out["gen3.nccl"]
        # plain torch refuses both too, only later or less plainly
        assert plain[r]["out"]["gen3.mpi"] and plain[r]["out"]["gen3.nccl"]
