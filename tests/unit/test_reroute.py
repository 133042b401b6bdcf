"""A reroute's flow against the unplanned tests' fakes (commander, Slurm, spares; real registry,
journal and metrics): every rank's collectives are cut at once, every node recovers its own state
(a rank one step behind loads a leader's), all re-form over the new interface and resume at the
failed step; no spare is taken, no node evicted, and the registry says the job is on the new path."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.unit.test_unplanned import World, _hb
from torchpassd import journal as jn
from torchpassd.reroute import MODE, Reroute
from torchpassd.unplanned import UnplannedPlan

NODES = ("n1", "n2", "n3", "n4")


def test_a_reroute_cuts_every_rank_and_reforms_them_all_over_the_new_path(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5"], steps={"n1": 42, "n2": 41, "n3": 42, "n4": 42})  # n2 one step behind

    async def go() -> str:
        await w.setup()
        await w.registry.on_message("n3", _hb("n3", 2, 40, "running"))  # every node is alive here
        for lp in w.registry.job("7").launchpads.values():
            lp.path = "eth1"
        mid = w.journal.start_migration("7", mode=MODE, source="n2", reason="eth1 down on n2", gen=w.gen)
        plan = UnplannedPlan(job="7", source="n2", gen=w.gen, evidence=["eth1 down on n2"],
                             failed_at=time.time() - 0.5, path="eth0", path_before="eth1")
        flow = Reroute(w.deps, plan, mid, detected_at=time.time(), no_spare="wait")
        interrupt = asyncio.create_task(w.interrupt())
        status = await flow.run([])
        await interrupt
        return status
    status = asyncio.run(go())
    assert status == jn.SUCCEEDED, w.journal.history()[0].error
    sent = w.commander.sent
    assert {n for n, c, _, a in sent if c == "sever" and a["all"] is True} == set(NODES)  # cut at once, everywhere
    recover = {n: a for n, c, _, a in sent if c == "recover"}
    assert set(recover) == set(NODES) and "load_from" in recover["n2"]  # the lagging rank takes a leader's state
    assert all(a["step"] == 42 for a in recover.values())
    reforms = {n: a for n, c, g, a in sent if c == "reform" and g == w.gen + 1}
    assert set(reforms) == set(NODES) and {a["ifname"] for a in reforms.values()} == {"eth0"}
    # nobody left: the job's own rendezvous store (launchpad's default) and its size as before
    assert all("store_port" not in a and a["world_size"] == 4 for a in reforms.values())
    assert all(a["world_size"] == 4 for a in recover.values())
    assert {n for n, c, _, _ in sent if c == "resume"} == set(NODES)
    assert w.slurm.added == [] and w.slurm.evicted == [] and w.slurm.free == ["n5"]  # no spare, nobody out
    assert {lp.path for lp in w.registry.job("7").launchpads.values()} == {"eth0"}
    (rec,) = w.journal.history()
    assert rec.mode == MODE and rec.status == jn.SUCCEEDED and rec.target in (None, "")
    resumed = next(p for p in rec.phases if p.phase == "resumed")
    assert resumed.detail["resumed_at_step"] == 42 and resumed.detail["pause_s"] > 0
    w.close()
