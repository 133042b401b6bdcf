"""Letting a job's user into the spare reservation (to grow the job by a spare) is journaled while
it lasts: a torchpassd that stops in between finds the grant at its next start and undoes it (the
helper allocation cancelled, the user out of the reservation), so the reservation, the job and the
journal agree again. Against a stand-in slurmctld that keeps the reservation's users and jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurm_plugin.model import Job, Reservation
from slurm_plugin.resize import JobResizer
from torchpassd.journal import Journal

RESV = "torchpass_spares"


class Slurmctld:
    """The commands the resizer runs, the reservation's users, and job 7 (user bob) on n1, n2."""

    def __init__(self, journal: Journal, *, crash_in_salloc: bool = False) -> None:
        self.journal = journal
        self.users: list[str] = ["root"]
        self.nodes = ["n1", "n2"]
        self.commands: list[list[str]] = []
        self.crash_in_salloc = crash_in_salloc
        self.crashed = False
        self.grants_during_salloc: list[tuple[str, str, str]] = []

    # SlurmRunner
    def run(self, argv: list[str], **kw: Any) -> str:
        if self.crashed:  # SIGKILL: nothing after it runs, no finally clause either
            raise SystemExit("torchpassd killed")
        self.commands.append(list(argv))
        if argv[-1].startswith("Users+="):
            self.users.append(argv[-1].split("=", 1)[1])
        elif argv[-1].startswith("Users-="):
            self.users.remove(argv[-1].split("=", 1)[1])
        elif argv[0] == "salloc":
            self.grants_during_salloc = self.journal.open_grants()
            if self.crash_in_salloc:
                self.crashed = True
                raise SystemExit("torchpassd killed")
            return "salloc: Granted job allocation 99\n"
        elif argv[:2] == ["scontrol", "update"] and argv[2] == "jobid=99":
            self.nodes.append("n5")
        return ""

    # SlurmClient
    def job(self, job_id: int) -> Job:
        return Job(job_id, "train", "bob", "RUNNING", tuple(self.nodes))

    def reservations(self) -> dict[str, Reservation]:
        return {RESV: Reservation(RESV, ("n5",), "ACTIVE", tuple(self.users))}


def test_a_grant_is_journaled_only_while_it_lasts(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    ctld = Slurmctld(journal)
    JobResizer(ctld, ctld, spare_reservation=RESV, grants=journal).add_node(7, "n5")  # type: ignore[arg-type]
    assert ctld.grants_during_salloc == [(RESV, "bob", "7")]
    assert journal.open_grants() == [] and ctld.users == ["root"] and "n5" in ctld.nodes
    journal.close()


def test_a_grant_left_open_by_a_crash_is_undone_at_the_next_start(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    ctld = Slurmctld(journal, crash_in_salloc=True)
    with pytest.raises(SystemExit):
        JobResizer(ctld, ctld, spare_reservation=RESV, grants=journal).add_node(7, "n5")  # type: ignore[arg-type]
    journal.close()
    assert ctld.users == ["root", "bob"]  # bob may now allocate spares: not for long

    journal = Journal(tmp_path / "j.sqlite")  # the next torchpassd
    ctld.commands.clear()
    ctld.crashed = ctld.crash_in_salloc = False
    undone = JobResizer(ctld, ctld, spare_reservation=RESV, grants=journal).reconcile_grants()  # type: ignore[arg-type]
    assert undone == [("bob", "7")]
    assert ctld.users == ["root"] and journal.open_grants() == []
    assert ctld.commands == [["scancel", "--name=torchpass-expand-7", "--user=bob"],
                             ["scontrol", "update", f"reservationname={RESV}", "Users-=bob"]]
    assert JobResizer(ctld, ctld, spare_reservation=RESV, grants=journal).reconcile_grants() == []  # type: ignore[arg-type]
    journal.close()


def test_a_grant_slurm_no_longer_shows_is_closed_without_touching_the_reservation(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    journal.grant_opened(RESV, "carol", "8")  # the crash came before Slurm was asked
    ctld = Slurmctld(journal)
    assert JobResizer(ctld, ctld, spare_reservation=RESV, grants=journal).reconcile_grants() == [("carol", "8")]  # type: ignore[arg-type]
    assert not any(c[-1].startswith("Users") for c in ctld.commands) and journal.open_grants() == []
    journal.close()
