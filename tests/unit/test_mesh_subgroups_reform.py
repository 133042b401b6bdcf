"""Subgroups, DeviceMesh, FSDP2, HSDP, tensor parallel, functional and object collectives on
TorchPass groups across re-formations: four real worker processes on gloo run WORKLOAD with the
TorchPass default group installed and re-form it (generation 2, then 3) between its phases; the
same workload on plain gloo, never re-formed, is the reference. Every result (collective values,
losses as float.hex, parameter hashes) must be right and bit-identical to the reference."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.support.group_workers import REFORM, plain_and_reformed

WORLD = 4

# The workload, also run by tests/integration/test_mesh_under_launchpad.py under launchpad and
# torchrun. Each rank writes its results to $MESH_RESULT_DIR/rank<N>.json (a file, not stdout: four
# ranks' 12 kB lines interleave on a shared pipe). With MESH_TEST_REFORM=1 it re-forms
# the TorchPass default group (and so every subgroup) between phases, as the agent does on REFORM.
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
out, kinds, gens = {}, {}, {}


def put(key, value):
    assert key not in out, key
    out[key] = value


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def build_models():
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    models = {}
    torch.manual_seed(0)
    m = net()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh1)
    models["fsdp"] = fully_shard(m, mesh=mesh1)
    torch.manual_seed(0)
    models["hsdp"] = fully_shard(net(), mesh=mesh2)
    torch.manual_seed(0)
    models["tp"] = parallelize_module(net(), mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opts = {k: torch.optim.Adam(v.parameters(), lr=1e-2) for k, v in models.items()}
    return models, opts, {"mesh1": mesh1, "mesh2": mesh2}


def train(tag, models, opts, first_step):
    for name, model in models.items():
        losses = []
        for step in range(first_step, first_step + 2):
            g = torch.Generator().manual_seed(1000 * step + (0 if name == "tp" else rank))
            x = torch.randn(4, 8, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            losses.append(loss.item().hex())
        put(f"{tag}.train.{name}.losses", losses)
        put(f"{tag}.train.{name}.params", digest(model))


def on_group(tag, label, group, members):
    """Every API on one group (members: its global ranks, sorted)."""
    kinds[label] = type(group).__name__
    gens[f"{tag}.{label}"] = getattr(group, "gen", None)  # the generation of its communicator
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    put(f"{tag}.{label}.all_reduce", t.item())
    put(f"{tag}.{label}.funcol", funcol.all_reduce(torch.tensor([float(rank + 1)]), "sum", group).item())
    objs = [None] * len(members)
    dist.all_gather_object(objs, {"rank": rank, "tag": tag}, group=group)
    put(f"{tag}.{label}.all_gather_object", objs)
    box = [{"from": rank, "tag": tag}]
    dist.broadcast_object_list(box, src=members[0], group=group)
    put(f"{tag}.{label}.broadcast_object_list", box[0])
    dist.barrier(group=group)
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=60))
    put(f"{tag}.{label}.name_resolves", dist.distributed_c10d._resolve_process_group(group.group_name) is group)


def make_groups(tag):
    """Groups a phase makes: new_group, new_subgroups and a 2-D mesh's dimension groups."""
    made = {}
    for ranks in ([0, 1], [2, 3]):
        g = dist.new_group(ranks)
        if rank in ranks:
            made[f"new_group{ranks[0]}{ranks[1]}"] = (g, ranks)
    sub, subs = dist.new_subgroups(2)
    made["new_subgroups"] = (sub, dist.get_process_group_ranks(sub))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        made[f"mesh_{dim}"] = (g, sorted(dist.get_process_group_ranks(g)))
    made["mesh"] = mesh
    return made


def phase(tag, earlier):
    on_group(tag, "world", dist.group.WORLD, list(range(world)))
    mesh1 = init_device_mesh("cpu", (world,))
    on_group(tag, "mesh1d", mesh1.get_group(), list(range(world)))
    groups = make_groups(tag)
    for origin, made in (("now", groups), *earlier):
        mesh = made["mesh"]
        for i, dim in enumerate(("dp", "tp")):
            t = funcol.all_reduce(torch.tensor([float(rank)]), "sum", (mesh, i))
            put(f"{tag}.{origin}.mesh_funcol_{dim}", t.item())
        for label, value in made.items():
            if label != "mesh":
                on_group(tag, f"{origin}.{label}", *value)
    return groups


''' + REFORM + r'''
models, opts, meshes = build_models()
for name, mesh in meshes.items():
    for i in range(mesh.ndim):
        kinds[f"{name}.dim{i}"] = type(mesh.get_group(i)).__name__
train("gen1", models, opts, 0)
first = phase("gen1", [])
reform(2)
train("gen2", models, opts, 2)
second = phase("gen2", [("made1", first)])
reform(3)
train("gen3", models, opts, 4)
phase("gen3", [("made1", first), ("made2", second)])
with open(os.path.join(os.environ["MESH_RESULT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "out": out, "kinds": kinds, "gens": gens}, f, sort_keys=True)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return plain_and_reformed(tmp_path_factory, WORKLOAD, WORLD)


GENS = ("gen1", "gen2", "gen3")


def _pick(rec: dict, part: str) -> dict:
    return {k: v for k, v in rec["out"].items() if part in k}


def _same_as_reference(runs, part: str) -> dict[int, dict]:
    plain, reformed = runs
    got = {r: _pick(reformed[r], part) for r in range(WORLD)}
    assert got[0], f"no results for {part}"
    assert got == {r: _pick(plain[r], part) for r in range(WORLD)}
    return got


def test_every_group_was_a_torchpass_group_and_was_reformed(runs):
    """Default group, new_group, new_subgroups and mesh dimension groups (those made before a
    re-formation too) all ran on the communicator of the current generation."""
    plain, reformed = runs
    for r in range(WORLD):
        kinds = reformed[r]["kinds"]
        assert kinds and set(kinds.values()) == {"TorchPassGroup"}, kinds
        assert reformed[r]["out"]["reformed2"] and reformed[r]["out"]["reformed3"]
        assert set(plain[r]["kinds"].values()) == {"ProcessGroup"}
        gens = reformed[r]["gens"]
        assert len(gens) == 6 + 10 + 14, gens  # per phase: world, mesh1d, 4 kinds x its 1, 2, 3 origins
        for key, gen in gens.items():
            assert gen == int(key[3]), f"rank {r}: {key} ran on generation {gen}"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fsdp", "hsdp", "tp"])
def test_training_is_bit_identical_across_reformations(runs, model):
    """FSDP2 on a 1-D mesh, HSDP on a 2-D mesh, tensor parallel: same losses and parameters."""
    got = _same_as_reference(runs, f".train.{model}.")
    for r in range(WORLD):
        for gen in GENS:
            assert len(got[r][f"{gen}.train.{model}.losses"]) == 2
    # full parameters are the same on every rank (sharded, replicated or split by columns/rows)
    assert len({got[r][f"gen3.train.{model}.params"] for r in range(WORLD)}) == 1


def _expected_sum(members: list[int]) -> float:
    return float(sum(m + 1 for m in members))


def _groups_of(rank: int) -> dict[str, list[int]]:
    pair = [0, 1] if rank < 2 else [2, 3]
    return {"world": [0, 1, 2, 3], "mesh1d": [0, 1, 2, 3], f"new_group{pair[0]}{pair[1]}": pair,
            "new_subgroups": pair, "mesh_dp": [rank % 2, rank % 2 + 2], "mesh_tp": pair}


def _labels(gen: str) -> list[tuple[str, str]]:
    """(label prefix, group kind) of the groups a phase used: its own, and those made earlier."""
    origins = {"gen1": ["now"], "gen2": ["now", "made1"], "gen3": ["now", "made1", "made2"]}[gen]
    kinds = ["new_group", "new_subgroups", "mesh_dp", "mesh_tp"]
    return [("world", "world"), ("mesh1d", "mesh1d")] + [(f"{o}.{k}", k) for o in origins for k in kinds]


def _check_api(runs, api: str, expect) -> None:
    got = _same_as_reference(runs, f".{api}")
    for r in range(WORLD):
        groups = _groups_of(r)
        for gen in GENS:
            for prefix, kind in _labels(gen):
                members = next(v for k, v in groups.items() if k.startswith(kind))
                label = prefix if kind in ("world", "mesh1d") else prefix.replace(kind, next(
                    k for k in groups if k.startswith(kind)))
                key = f"{gen}.{label}.{api}"
                assert key in got[r], f"rank {r}: {key} missing"
                assert got[r][key] == expect(r, gen, members), (r, key, got[r][key])


def test_all_reduce_on_every_group_kind(runs):
    _check_api(runs, "all_reduce", lambda r, gen, members: _expected_sum(members))


def test_functional_all_reduce_resolves_groups_by_name(runs):
    _check_api(runs, "funcol", lambda r, gen, members: _expected_sum(members))
    _check_api(runs, "name_resolves", lambda r, gen, members: True)


def test_functional_all_reduce_on_mesh_dimensions(runs):
    got = _same_as_reference(runs, ".mesh_funcol_")
    for r in range(WORLD):
        dp, tp = float(r % 2 + r % 2 + 2), float(sum([0, 1] if r < 2 else [2, 3]))
        for gen in GENS:
            for origin in {"gen1": ["now"], "gen2": ["now", "made1"], "gen3": ["now", "made1", "made2"]}[gen]:
                assert got[r][f"{gen}.{origin}.mesh_funcol_dp"] == dp
                assert got[r][f"{gen}.{origin}.mesh_funcol_tp"] == tp


def test_all_gather_object(runs):
    _check_api(runs, "all_gather_object", lambda r, gen, members: [{"rank": m, "tag": gen} for m in members])


def test_broadcast_object_list(runs):
    _check_api(runs, "broadcast_object_list", lambda r, gen, members: {"from": members[0], "tag": gen})


def test_groups_made_before_a_reformation_keep_working_after_it(runs):
    _, reformed = runs
    out = reformed[0]["out"]
    for key in ("gen2.made1.new_group01.all_reduce", "gen3.made1.mesh_dp.all_reduce",
                "gen3.made2.new_subgroups.all_reduce", "gen3.made2.mesh_tp.funcol"):
        assert key in out


def test_unsupported_second_backend_group_is_refused_clearly():
    """A torchpass-backend group made outside new_group would never be re-formed: refused, naming why."""
    from torchpass import default_group
    from torchpass_common.errors import WorkerError

    saved = default_group._group
    default_group._group = object()  # type: ignore[assignment]
    try:
        with pytest.raises(WorkerError, match="outside new_group"):
            default_group._create(dist.HashStore(), 0, 2, timedelta(seconds=5))
    finally:
        default_group._group = saved
