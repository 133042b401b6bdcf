"""The failure detector's fusion of synthetic signals: a killed node (Last Will + interrupted
survivors) is decided at once, a cut node (heartbeats stop) after heartbeat_dead_after, slurmctld's
DOWN corroborates; no decision for a slow step, a broker outage, a clean end, a goodbye, a node
that left the job or one a planned migration owns; one decision per node."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_plugin import events as ev
from torchpass_common import protocol
from torchpass_common.timeouts import Timeouts
from torchpassd.failure_detect import Death, FailureDetector, is_last_will

NODES = ("n1", "n2", "n3", "n4")


class Harness:
    def __init__(self, busy: dict[str, str] | None = None) -> None:
        self.now = 1000.0
        self.deaths: list[Death] = []
        self.broker_up = True
        self.members = NODES
        self.det = FailureDetector(Timeouts(heartbeat_interval=1.0, heartbeat_missed=5), on_death=self.deaths.append,
                                   busy=lambda job, node: (busy or {}).get(node, ""),
                                   nodes_of=lambda job: self.members, control_up=lambda: self.broker_up,
                                   clock=lambda: self.now)
        self.det.check()  # torchpassd connected at t=1000

    def hb(self, node: str, step: int, state: str = "running", **extra: Any) -> None:
        body = {"node": node, "seq": 1, "workers": [{"rank": int(node[1:]) - 1, "step": step, "state": state,
                                                     **extra}]}
        self.det.on_message(node, protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1, body=body)))

    def state(self, node: str, online: bool, **extra: Any) -> None:
        body = {"node": node, "online": online, **extra}
        self.det.on_message(node, protocol.decode(protocol.encode(protocol.STATE, job="7", gen=1, body=body)))

    def run(self, seconds: float, alive: tuple[str, ...] = NODES, state: str = "running") -> None:
        """Time passes; the ``alive`` launchpads heartbeat every second."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + 1.0)
            for n in alive:
                self.hb(n, 10, state)
            self.det.check()


def test_killed_node_is_decided_at_once_from_last_will_and_interrupted_survivors() -> None:
    h = Harness()
    h.run(6)
    h.now += 0.2
    h.state("n3", False)  # the broker publishes n3's Last Will (no pid: not its goodbye)
    assert h.deaths == []  # a Last Will alone could be a blip in the broker connection
    h.now += 0.05
    h.hb("n1", 10, "interrupted", registered=True, error="gloo: connection reset")
    assert [d.node for d in h.deaths] == ["n3"]
    d = h.deaths[0]
    assert d.ranks == (2,) and d.job == "7"
    assert any("Last Will" in e for e in d.evidence) and any("interrupted on n1" in e for e in d.evidence)
    assert d.detect_s == pytest.approx(0.05)
    h.run(10, alive=("n1", "n2", "n4"), state="interrupted")
    assert len(h.deaths) == 1  # decided once


def test_last_will_is_confirmed_by_a_short_silence_without_interruptions() -> None:
    h = Harness()
    h.run(6)
    h.state("n4", False)
    h.run(1, alive=("n1", "n2", "n3"))
    assert h.deaths == []
    h.run(1.5, alive=("n1", "n2", "n3"))
    assert [d.node for d in h.deaths] == ["n4"]


def test_cut_node_is_decided_after_heartbeat_dead_after() -> None:
    h = Harness()
    h.run(6)
    h.run(4, alive=("n1", "n2", "n4"))  # n3 cut: its heartbeats stop, its Last Will comes later
    assert h.deaths == []
    h.run(1.5, alive=("n1", "n2", "n4"))
    assert [d.node for d in h.deaths] == ["n3"]
    assert "no heartbeat" in h.deaths[0].evidence[0]
    assert 4.0 <= h.deaths[0].detect_s <= 6.0  # counted from the heartbeat that did not come


def test_a_slow_step_is_no_failure() -> None:
    h = Harness()
    h.run(60)  # steps stuck at 10 for a minute, heartbeats keep coming
    assert h.deaths == []


def test_survivor_interruption_alone_names_no_node() -> None:
    h = Harness()
    h.run(6)
    h.run(3, state="interrupted")  # every node heartbeats; a worker interrupted for its own reason
    assert h.deaths == []


def test_broker_outage_silences_everyone_and_proves_nothing() -> None:
    h = Harness()
    h.run(6)
    h.run(20, alive=())  # nobody heartbeats: no peer is fresh
    assert h.deaths == []
    h.broker_up = False
    h.run(20, alive=())
    h.broker_up = True
    h.run(3)  # back, and torchpassd must hear the broker heartbeat_dead_after before judging silence
    assert h.deaths == []


def test_clean_end_and_goodbyes_are_no_failure() -> None:
    h = Harness()
    h.run(6)
    h.hb("n2", 50, "exited", exit_code=0)
    h.state("n2", False, pid=123, host="n2")
    h.run(10, alive=("n1", "n3", "n4"))
    assert h.deaths == []  # its workers ended
    h.state("n4", False, pid=124, host="n4")  # a goodbye while its worker ran: a stopped launchpad
    h.run(10, alive=("n1", "n3"))
    assert h.deaths == []  # no peer interrupted: nothing failed (yet)


def test_goodbyes_of_a_job_told_to_end_are_no_failure() -> None:
    h = Harness()
    h.run(6)
    h.run(3, state="interrupted")  # survivors parked, told to exit (a recovery failed): they say goodbye
    h.state("n4", False, pid=124, host="n4")
    h.run(10, alive=("n1", "n2", "n3"), state="interrupted")
    assert h.deaths == []
    h.det.on_slurm(ev.NodeNotResponding(0.0, "n4", (7,)))  # slurmctld lost it too: that is a failure
    h.det.check()
    assert [d.node for d in h.deaths] == ["n4"]


def test_slurm_down_corroborates_a_silent_node_but_not_a_live_one() -> None:
    h = Harness()
    h.run(6)
    h.det.on_slurm(ev.NodeDown(0.0, "n2", (7,), "Not responding"))
    h.run(3)
    assert h.deaths == []  # slurmd died but launchpad and workers still run
    h.det.on_slurm(ev.NodeNotResponding(0.0, "n3", (7,)))
    h.run(2.5, alive=("n1", "n2", "n4"))
    assert [d.node for d in h.deaths] == ["n3"] and "slurmctld: NodeNotResponding" in h.deaths[0].evidence


def test_node_of_a_planned_migration_is_deferred_and_one_that_left_is_ignored() -> None:
    h = Harness(busy={"n3": "a planned migration off n3 runs"})
    h.run(6)
    h.state("n3", False)
    h.run(10, alive=("n1", "n2", "n4"), state="interrupted")
    assert h.deaths == []
    h.members = ("n1", "n2", "n3", "n5")  # n4 left the job (released after a migration)
    h.state("n4", False)
    h.run(10, alive=("n1", "n2", "n5"), state="interrupted")
    assert h.deaths == []


def test_undecide_allows_a_new_decision_and_job_end_forgets() -> None:
    h = Harness()
    h.run(6)
    h.state("n3", False)
    h.run(3, alive=("n1", "n2", "n4"))
    assert len(h.deaths) == 1
    h.det.undecide("7", "n3")
    h.run(1, alive=("n1", "n2", "n4"))
    assert len(h.deaths) == 2
    h.det.on_slurm(ev.JobEnded(0.0, 7, NODES, "COMPLETED"))
    assert h.det.jobs == {}


def test_last_will_is_told_from_a_goodbye() -> None:
    assert is_last_will({"node": "n1", "online": False})
    assert is_last_will({"node": "n1", "online": False, "will": True, "pid": 1})
    assert not is_last_will({"node": "n1", "online": False, "pid": 7, "host": "n1"})
    assert not is_last_will({"node": "n1", "online": True})


def test_a_node_proven_alive_needs_harder_evidence() -> None:
    h = Harness()
    h.run(6)
    h.state("n3", False)
    h.run(3, alive=("n1", "n2", "n4"))
    assert len(h.deaths) == 1
    h.det.undecide("7", "n3", proven_alive=True)  # the survivors trained on: only its launchpad died
    h.run(10, alive=("n1", "n2", "n4"))
    assert len(h.deaths) == 1
    h.run(1, alive=("n1", "n2", "n4"), state="interrupted")  # now its rank is really gone
    assert len(h.deaths) == 2


def test_a_joiner_is_its_migrations_business_and_a_member_once_the_migration_ended() -> None:
    """While the migration that brings n5 in runs, n5 is not judged; once it ended n5 is a member,
    even though its last heartbeat (sent just before the resume) still called its worker joining:
    n5 dying right after the hand-over is decided (the fault matrix found it never was)."""
    busy = {"n5": "a migration is bringing n5 into the job"}
    h = Harness(busy=busy)
    h.members = (*NODES, "n5")
    h.run(6)
    h.hb("n5", 0, "joining", joining=True)  # a planned migration's joiner on the spare
    h.run(10, alive=NODES)
    assert h.deaths == []
    busy.clear()  # the migration resumed the job with n5's worker in it
    h.run(10, alive=NODES)
    assert [d.node for d in h.deaths] == ["n5"]


def test_a_node_that_left_and_comes_back_as_a_spare_is_judged_afresh() -> None:
    """n3 left the job (its ranks moved off it, its launchpad gone) and later joins it again as
    the spare of another migration: until its new launchpad reports workers, its old silence is
    no evidence (torchpassd once judged it dead there and rolled the migration back)."""
    h = Harness()
    h.run(3)
    h.members = ("n1", "n2", "n4", "n5")  # n3's ranks moved to n5, n3 released
    h.state("n3", False, goodbye=True)
    h.run(10, alive=("n1", "n2", "n4", "n5"))
    h.members = ("n1", "n2", "n3", "n4", "n5")  # back, as the spare a drain of n2 took
    h.run(10, alive=("n1", "n2", "n4", "n5"))
    assert h.deaths == []


def test_a_restarted_torchpassd_recalls_the_dead_nodes_ranks_from_its_journal() -> None:
    """A fresh torchpassd never hears the dead node's heartbeats: its retained Last Will and the
    parked survivors decide nothing until the journal's unfinished recovery names its ranks."""
    h = Harness()
    h.state("n3", False, will=True)  # the broker's retained Last Will of n3's launchpad
    h.run(3, alive=("n1", "n2", "n4"), state="interrupted")
    assert h.deaths == []
    h.det.recall("7", "n3", [2])
    assert [(d.node, d.ranks) for d in h.deaths] == [("n3", (2,))]
    assert "launchpad Last Will (unclean disconnect)" in h.deaths[0].evidence


def test_a_worker_killed_on_a_live_node_is_decided_at_once_as_an_in_place_loss_of_its_rank_only() -> None:
    h = Harness()
    h.run(3)
    h.hb("n3", 10, "crashed", pid=4242, exit_code=-9)  # launchpad holds it and beats at once
    assert len(h.deaths) == 1
    d = h.deaths[0]
    assert (d.node, d.ranks, d.in_place) == ("n3", (2,), True)
    assert "killed by signal SIGKILL" in d.evidence[0] and "alive" in d.evidence[0]
    h.run(5)  # its launchpad beats on (the joiner rebuilding rank 2 runs)
    h.hb("n3", 10, "crashed", pid=4242, exit_code=-9)
    assert len(h.deaths) == 1, "the same crash is decided once"
    h.hb("n3", 12, "crashed", pid=5151, exit_code=-11)  # its replacement crashed too: a new decision
    assert [(x.in_place, x.ranks) for x in h.deaths[1:]] == [(True, (2,))]
    assert "SIGSEGV" in h.deaths[1].evidence[0]


def test_a_node_that_dies_after_one_of_its_workers_crashed_is_still_decided_dead() -> None:
    h = Harness()
    h.run(3)
    h.hb("n3", 10, "crashed", pid=4242, exit_code=-9)
    h.now += 0.5
    h.state("n3", False)  # then the whole node goes: its Last Will
    h.hb("n1", 10, "interrupted", registered=True, error="gloo: connection reset")
    assert [(d.node, d.in_place) for d in h.deaths] == [("n3", True), ("n3", False)]


def test_a_crash_while_a_planned_migration_owns_the_node_waits_for_it() -> None:
    h = Harness(busy={"n3": "a planned migration off n3 runs"})
    h.run(3)
    h.hb("n3", 10, "crashed", pid=4242, exit_code=-9)
    assert h.deaths == []


def test_a_frozen_worker_killed_by_the_watchdog_counts_its_frozen_time_as_detection() -> None:
    h = Harness()
    h.run(3)
    h.hb("n3", 10, "crashed", pid=4242, exit_code=-9, frozen_s=3.5)
    [d] = h.deaths
    assert d.in_place and "frozen" in d.evidence[0] and d.detect_s == pytest.approx(3.5)
