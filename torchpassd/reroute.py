"""A reroute (issue 24): a job's collectives move to another network path and no rank moves. A
link that went down has usually stranded a collective in flight (its TCP connections neither
deliver nor fail), so a step boundary is never reached: a reroute is the unplanned recovery with
nobody lost. Every rank's collectives are cut at once, each rank keeps its just-in-time state (a
rank one step behind takes a leader's, as in any recovery), all re-form generation G+1 over the
new interface (launchpad relays ``ifname``; gloo and NCCL build their groups on it) and resume at
the step that failed: no spare, no state lost, bit-identical. A node that dies meanwhile joins
the same recovery. link_policy.py decides; the orchestrator (daemon.py) starts it as the job's
one running change, through the unplanned driver."""

from __future__ import annotations

from typing import Any

from torchpassd import journal as jn
from torchpassd import unplanned
from torchpassd.failure_detect import Death

MODE = "reroute"


class Reroute(unplanned.UnplannedRecovery):
    """The reroute of ``plan.job``'s collectives from ``plan.path_before`` to ``plan.path``;
    ``plan.source`` names the node whose link made it happen; ``run([])`` drives it."""

    mode = MODE

    async def run(self, deaths: list[Death]) -> str:
        view = self.view()  # every rank stays: the job's size is what its launchpads run
        self.plan.world_size = len({w["rank"] for lp in view.launchpads.values() if lp.online for w in lp.workers})
        return await super().run(deaths)

    def _reform_args(self, gen: int) -> dict[str, Any]:
        """Over the new path. The store: the one every launchpad of the job rendezvoused on (its
        default), unless a node died meanwhile and its seat read the workers' store (a joiner knows
        no other)."""
        args = {**super()._reform_args(gen), "ifname": self.plan.path}
        if not self.plan.store_port:
            del args["store_host"], args["store_port"]
        return args

    async def finish(self) -> str:
        """The recovery's re-form and resume; once they succeeded the registry says at once that the
        job's launchpads run on the new path (their next heartbeats say it too), so a decision made
        from a heartbeat of before the re-form does not start another reroute."""
        status = await super().finish()
        if status == jn.SUCCEEDED:
            view = self.view()
            for n in self.plan.members:
                if (lp := view.launchpads.get(n)) is not None:
                    lp.path = self.plan.path
        return status
