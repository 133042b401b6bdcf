"""The watcher's change detection: which transitions of nodes, TorchPass jobs and spares become
which events (the live timings are measured in tests/integration/test_slurm_adapter.py)."""

from slurm_plugin import events as ev
from slurm_plugin.model import Job, Node, Reservation, Snapshot
from slurm_plugin.watcher import diff

RESV = "torchpass_spares"
MARK = "torchpass:mode=aware,spares=0"


def snap(nodes: dict[str, tuple[str, set[str]]], jobs: list[Job], spares: tuple[str, ...] = ("n5",),
         at: float = 1.0) -> Snapshot:
    return Snapshot(
        nodes={n: Node(n, state, frozenset(flags), reason="why" if flags else "",
                       reason_by="root" if flags else "") for n, (state, flags) in nodes.items()},
        jobs={j.job_id: j for j in jobs},
        reservations={RESV: Reservation(RESV, spares, "ACTIVE")},
        taken_at=at)


def job(job_id: int, nodes: tuple[str, ...], comment: str = MARK, state: str = "RUNNING") -> Job:
    return Job(job_id, "train", "alice", state, nodes, nodes[0], "main", comment)


IDLE = ("idle", set())
BUSY = ("mixed", set())
SPARE = ("idle", {"RESERVED"})


def kinds(events: list[ev.SlurmEvent]) -> list[str]:
    return [type(e).__name__ for e in events]


def test_first_poll_reports_what_is_already_true() -> None:
    now = snap({"n1": BUSY, "n2": ("mixed", {"DRAIN"}), "n5": SPARE}, [job(7, ("n1", "n2"))])
    found = diff(None, now, RESV)
    assert kinds(found) == ["JobStarted", "NodeDraining", "SpareAdded"]
    started, draining = found[0], found[1]
    assert (started.job, started.nodes, started.mode, started.user) == (7, ("n1", "n2"), "aware", "alice")
    assert (draining.node, draining.jobs, draining.reason, draining.reason_by) == ("n2", (7,), "why", "root")


def test_drain_down_and_return_of_a_torchpass_node() -> None:
    j = job(7, ("n1", "n2"))
    base = snap({"n1": BUSY, "n2": BUSY, "n5": SPARE}, [j])
    drained = snap({"n1": BUSY, "n2": ("mixed", {"DRAIN"}), "n5": SPARE}, [j], at=2)
    assert kinds(diff(base, drained, RESV)) == ["NodeDraining"]
    unresponsive = snap({"n1": BUSY, "n2": ("mixed", {"NOT_RESPONDING"}), "n5": SPARE}, [j], at=3)
    assert kinds(diff(base, unresponsive, RESV)) == ["NodeNotResponding"]
    # --no-kill: slurmctld removes the DOWN node from the job in the same instant
    down = snap({"n1": BUSY, "n2": ("down", {"NOT_RESPONDING"}), "n5": SPARE}, [job(7, ("n1",))], at=4)
    found = diff(unresponsive, down, RESV)
    assert kinds(found) == ["JobResized", "NodeDown"]
    assert found[0].removed == ("n2",) and found[1].jobs == (7,)
    back = snap({"n1": BUSY, "n2": IDLE, "n5": SPARE}, [job(7, ("n1",))], at=5)
    assert kinds(diff(down, back, RESV)) == []  # n2 is no longer a node of any TorchPass job


def test_nodes_of_other_jobs_are_ignored() -> None:
    other = job(8, ("n3",), comment="")
    before = snap({"n3": BUSY, "n5": SPARE}, [other])
    after = snap({"n3": ("mixed", {"DRAIN"}), "n5": SPARE}, [other])
    assert diff(before, after, RESV) == []


def test_job_lifecycle_and_growth_by_a_spare() -> None:
    empty = snap({"n1": IDLE, "n5": SPARE}, [])
    running = snap({"n1": BUSY, "n5": SPARE}, [job(7, ("n1",))])
    assert kinds(diff(empty, running, RESV)) == ["JobStarted"]
    grown = snap({"n1": BUSY, "n5": ("mixed", {"RESERVED"})}, [job(7, ("n1", "n5"))])
    found = diff(running, grown, RESV)
    assert kinds(found) == ["JobResized", "SpareRemoved"]
    assert found[0].added == ("n5",) and "in use by job 7" in found[1].why
    ended = snap({"n1": IDLE, "n5": SPARE}, [job(7, ("n1", "n5"), state="COMPLETED")])
    found = diff(grown, ended, RESV)
    assert kinds(found) == ["JobEnded", "SpareAdded"] and found[0].state == "COMPLETED"


def test_spare_health() -> None:
    ok = snap({"n5": SPARE}, [])
    drained = snap({"n5": ("idle", {"RESERVED", "DRAIN"})}, [])
    found = diff(ok, drained, RESV)
    assert kinds(found) == ["NodeDrained", "SpareRemoved"] and found[1].why == "drained: why"
    assert kinds(diff(drained, ok, RESV)) == ["NodeReturned", "SpareAdded"]
    moved = snap({"n4": IDLE, "n5": SPARE}, [], spares=("n4",))
    assert kinds(diff(ok, moved, RESV)) == ["SpareAdded", "SpareRemoved"]


def test_failed_flag_and_unknown_nodes() -> None:
    j = job(7, ("n1", "n2"))
    base = snap({"n1": BUSY, "n2": BUSY, "n5": SPARE}, [j])
    failed = snap({"n1": BUSY, "n2": ("mixed", {"FAIL"}), "n5": SPARE}, [j])
    assert kinds(diff(base, failed, RESV)) == ["NodeFailed"]
    vanished = snap({"n1": BUSY, "n5": SPARE}, [j])  # a node slurmctld no longer lists is skipped
    assert diff(base, vanished, RESV) == []


class ScriptedClient:
    """A SlurmClient that returns the given snapshots in turn (only what Watcher.poll calls)."""

    name = "scripted"

    def __init__(self, snaps: list[Snapshot]) -> None:
        self.snaps = snaps

    def snapshot(self) -> Snapshot:
        return self.snaps.pop(0)


def test_a_node_seen_leaving_the_job_before_it_is_seen_down_still_reports_down() -> None:
    """The commands backend reads jobs and nodes one after the other: one snapshot can show the
    failing node already out of the --no-kill job but not yet DOWN, the next one DOWN."""
    from slurm_plugin.watcher import Watcher

    unresponsive = ("mixed", {"NOT_RESPONDING"})
    w = Watcher(ScriptedClient([
        snap({"n1": BUSY, "n2": BUSY, "n5": SPARE}, [job(7, ("n1", "n2"))], at=1),
        snap({"n1": BUSY, "n2": unresponsive, "n5": SPARE}, [job(7, ("n1",))], at=2),
        snap({"n1": BUSY, "n2": ("down", {"NOT_RESPONDING"}), "n5": SPARE}, [job(7, ("n1",))], at=3),
        snap({"n1": BUSY, "n2": IDLE, "n5": SPARE}, [job(7, ("n1",))], at=4),
        snap({"n1": BUSY, "n2": ("down", set()), "n5": SPARE}, [job(7, ("n1",))], at=5),
    ]), spare_reservation=RESV)
    assert kinds(w.poll()) == ["JobStarted", "SpareAdded"]
    assert kinds(w.poll()) == ["JobResized", "NodeNotResponding"]
    down = w.poll()
    assert kinds(down) == ["NodeDown"] and down[0].jobs == (7,)
    assert kinds(w.poll()) == ["NodeReturned"]  # healthy again: no longer watched for job 7
    assert w.poll() == []
