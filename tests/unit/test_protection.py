"""Which migration protects a job, from what its workers did: a bare --torchpass (auto) moves
registered jobs model-aware and unregistered ones transparently, refuses a mixed job with the ranks
named; an aware job whose ranks never registered is refused before any spare is taken; nothing is
decided before every worker took a step. The job's output is told once, and again on a change."""

from __future__ import annotations

import asyncio
from typing import Any

from torchpassd import protection
from torchpassd.protection import Announcer, decide


def workers(registered: list[bool], *, movable: bool = True, step: int = 5) -> list[dict[str, Any]]:
    return [{"rank": r, "step": step, "state": "running", "registered": reg, "movable": movable}
            for r, reg in enumerate(registered)]


def test_auto_moves_a_registered_job_model_aware_and_an_unregistered_one_transparently() -> None:
    assert decide("auto", workers([True, True])).flow == "aware"
    assert decide("auto", workers([False, False])).flow == "transparent"


def test_auto_refuses_a_mixed_job_naming_the_ranks_on_each_side() -> None:
    got = decide("auto", workers([True, False, False, True]))
    assert got.flow == "" and got.known
    assert "ranks 1-2 never called torchpass.register" in got.why and "ranks 0, 3 did" in got.why
    assert "register in every rank for a model-aware move, or in none for a transparent one" in got.why


def test_aware_refuses_unregistered_ranks_and_says_what_to_do() -> None:
    got = decide("aware", workers([False, False]))
    assert got.flow == "" and "ranks 0-1 never called torchpass.register" in got.why
    assert "--torchpass=transparent" in got.why
    assert decide("aware", workers([True, True], movable=False)).flow == "aware"  # no criu needed
    assert decide("sideways", workers([False])).why == "unknown --torchpass mode 'sideways'"


def test_a_worker_that_cannot_move_whole_is_refused_for_transparent_moves() -> None:
    for mode in ("auto", "transparent"):
        got = decide(mode, workers([False, False], movable=False))
        assert got.flow == "" and "ranks 0-1 were not started movable" in got.why
    assert decide("transparent", workers([True, True])).flow == "transparent"  # asked for: criu it is


def test_nothing_is_decided_before_every_worker_took_a_step() -> None:
    early = workers([False, True])
    early[1]["step"] = 0  # it may still register before its first step
    got = decide("auto", early)
    assert not got.known and got.flow == "" and got.why == protection.AWAITING
    assert not decide("auto", []).known


def test_exited_workers_and_joiners_of_a_move_under_way_do_not_count() -> None:
    ws = workers([True, True]) + [{"rank": 2, "step": 0, "registered": False, "movable": True, "joining": True},
                                  {"rank": 3, "step": 9, "registered": False, "exit_code": 0}]
    assert decide("auto", ws).flow == "aware"


def test_the_job_is_told_once_when_known_and_again_when_it_changes() -> None:
    said: list[tuple[str, str]] = []
    state = {"ws": workers([False, False], step=0)}

    async def tell(job: str, text: str) -> None:
        said.append((job, text))

    async def main() -> None:
        ann = Announcer(lambda job: decide("auto", state["ws"]), tell)
        ann.on_heartbeat("7", "n1", {"workers": state["ws"]})  # not known yet: nothing said
        ann.tick()
        state["ws"] = workers([False, False])
        for _ in range(3):  # the same facts, heartbeat after heartbeat: said once
            ann.on_heartbeat("7", "n1", {"workers": state["ws"]})
            ann.tick()
            await asyncio.sleep(0)
        state["ws"] = workers([True, True])  # the script registered later on
        ann.on_heartbeat("7", "n1", {"workers": state["ws"]})
        ann.tick()
        ann.on_heartbeat("7", "n1", {"workers": "garbage"})  # a malformed report decides nothing new
        ann.tick()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [t for _, t in said] == [
        "job 7 is protected by transparent migration: the worker processes move whole with criu (no code change needed)",
        "job 7 is protected by aware migration: every rank registered save/load: its state moves to the spare"]


def test_a_job_whose_nodes_all_change_at_once_is_decided_once_a_tick() -> None:
    decided: list[str] = []

    async def tell(job: str, text: str) -> None:
        return None

    def decide_for(job: str) -> protection.Protection:
        decided.append(job)
        return decide("auto", workers([False]))

    async def main() -> None:
        ann = Announcer(decide_for, tell)
        for n in range(500):  # every node's workers take their first step
            ann.on_heartbeat("7", f"n{n}", {"workers": workers([False])})
        ann.tick()
        ann.tick()  # nothing changed since
    asyncio.run(main())
    assert decided == ["7"]


def test_what_protects_a_job_is_said_before_why_it_is_not_protected_right_now() -> None:
    """A drain blocked (no spare free) before the first tick: the job's output still reads
    protection first, even when telling that takes longer than telling the block."""
    said: list[str] = []

    async def tell(job: str, text: str) -> None:
        if "protected by" in text:
            await asyncio.sleep(0.05)  # a slow first notice (its command redelivered)
        said.append(text)

    async def main() -> None:
        ann = Announcer(lambda job: decide("auto", workers([True, True])), tell)
        ann.on_heartbeat("7", "n1", {"workers": workers([True, True])})
        await ann.said_first("7")
        await tell("7", "job 7 is not protected right now: no spare free")
        ann.tick()  # decided already: not said twice
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert said == ["job 7 is protected by aware migration: every rank registered save/load: its state moves to the spare",
                    "job 7 is not protected right now: no spare free"]
