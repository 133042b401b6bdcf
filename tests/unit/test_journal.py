"""The torchpassd journal on a real SQLite file: migration lifecycles with phase timings, what a
restarted daemon finds in flight, atomic writes, and nothing committed lost to a SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpassd.journal import (
    _SCHEMA,
    FAILED,
    ROLLED_BACK,
    RUNNING,
    SUCCEEDED,
    JobAfter,
    Journal,
    JournalError,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def journal(tmp_path: Path):
    with Journal(tmp_path / "state" / "journal.sqlite") as j:
        j.upsert_job("100", user="alice", mode="aware", state="running", gen=1, nodes=["n1", "n2"])
        yield j


def test_a_migration_is_recorded_phase_by_phase_with_timings(journal: Journal) -> None:
    mid = journal.start_migration("100", mode="planned-aware", source="n2", reason="drained: bad dimm", gen=1)
    assert [m.id for m in journal.in_flight()] == [mid]
    journal.record_transition(mid, "spare_chosen", RUNNING, {"spare": "n5"}, target="n5")
    time.sleep(0.02)
    journal.record_transition(mid, "paused", RUNNING, {"step": 40})
    journal.record_transition(mid, "resumed", SUCCEEDED, {"step": 41})

    m = journal.migration(mid)
    assert (m.job_id, m.source, m.target, m.gen, m.status, m.phase) == ("100", "n2", "n5", 1, SUCCEEDED, "resumed")
    assert [p.phase for p in m.phases] == ["requested", "spare_chosen", "paused", "resumed"]
    assert m.phases[2].detail == {"step": 40}
    assert m.phases[2].seconds >= 0.02  # time spent in spare_chosen before the pause
    assert m.seconds == pytest.approx(sum(p.seconds for p in m.phases))
    assert journal.in_flight() == []


def test_the_last_phase_and_the_jobs_new_generation_are_one_transaction(journal: Journal) -> None:
    mid = journal.start_migration("100", mode="planned-aware", source="n2", reason="drain", gen=1)
    journal.record_transition(mid, "released", SUCCEEDED, target="n5", job_after=JobAfter(2, ["n1", "n5"]))
    (job,) = journal.jobs()
    assert (job.gen, job.nodes) == (2, ["n1", "n5"])
    mid = journal.start_migration("100", mode="planned-aware", source="n1", reason="drain", gen=2)
    journal.record_transition(mid, "rolled_back", ROLLED_BACK)
    with pytest.raises(JournalError):  # refused as a whole: the job keeps generation 2
        journal.record_transition(mid, "released", SUCCEEDED, job_after=JobAfter(3, ["n5", "n6"]))
    assert (journal.jobs()[0].gen, journal.jobs()[0].nodes) == (2, ["n1", "n5"])


def test_a_slurm_update_of_a_job_keeps_the_generation_a_migration_gave_it(journal: Journal) -> None:
    mid = journal.start_migration("100", mode="planned-aware", source="n2", reason="drain", gen=1)
    journal.record_transition(mid, "released", SUCCEEDED, job_after=JobAfter(2, ["n1", "n5"]))
    journal.upsert_job("100", user="alice", mode="aware", state="RUNNING", nodes=["n1", "n5"])  # a JobResized
    journal.upsert_job("300", user="bob", mode="aware", state="RUNNING", nodes=["n7"])
    assert {j.job_id: j.gen for j in journal.jobs()} == {"100": 2, "300": 1}


def test_a_version_1_journal_is_brought_to_the_current_schema_with_its_data(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(f"{_SCHEMA.split('CREATE TABLE grants')[0]} PRAGMA user_version=1;")
    db.execute("INSERT INTO jobs VALUES ('5','u','aware','RUNNING',3,'[\"n1\"]','{}',0,0,NULL)")
    db.close()
    with Journal(path) as journal:
        assert [(j.job_id, j.gen) for j in journal.jobs()] == [("5", 3)]
        journal.grant_opened("torchpass_spares", "u", "5")
        assert journal.open_grants() == [("torchpass_spares", "u", "5")]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2


def test_an_ended_migration_refuses_further_transitions(journal: Journal) -> None:
    mid = journal.start_migration("100", mode="planned-aware", source="n2", reason="drain", gen=1)
    journal.record_transition(mid, "rolled_back", ROLLED_BACK, error="spare n5 died during hand-over")
    with pytest.raises(JournalError, match="already ended as rolled_back") as err:
        journal.record_transition(mid, "paused", RUNNING)
    assert "job=100" in str(err.value)
    assert journal.migration(mid).error == "spare n5 died during hand-over"
    with pytest.raises(JournalError, match="unknown migration status 'done'"):
        journal.record_transition(mid, "x", "done")
    with pytest.raises(JournalError, match="unknown migration nope"):
        journal.record_transition("nope", "x", RUNNING)


def test_history_is_newest_first_and_filters_by_job(journal: Journal) -> None:
    journal.upsert_job("200", user="bob", mode="aware", state="running", gen=1, nodes=["n3"])
    ids = [journal.start_migration(job, mode="planned-aware", source="n1", reason="r", gen=1)
           for job in ("100", "200", "100")]
    for mid in ids:
        journal.record_transition(mid, "failed", FAILED, error="x")
    assert [m.id for m in journal.history()] == ids[::-1]
    assert [m.id for m in journal.history(job_id="100")] == [ids[2], ids[0]]
    assert [m.id for m in journal.history(limit=1)] == [ids[2]]


def test_a_failed_write_leaves_no_partial_transaction(journal: Journal) -> None:
    mid = journal.start_migration("100", mode="planned-aware", source="n2", reason="r", gen=1)
    with pytest.raises(JournalError, match="UNIQUE constraint"):
        journal.start_migration("100", mode="planned-aware", source="n2", reason="r", gen=1, migration_id=mid)
    assert len(journal.migration(mid).phases) == 1
    with pytest.raises(JournalError, match="not JSON-serialisable"):
        journal.record_transition(mid, "paused", RUNNING, {"ranks": {1, 2}})
    with pytest.raises(JournalError, match="unknown job 999"):
        journal.start_migration("999", mode="planned-aware", source="n2", reason="r", gen=1)


def test_jobs_nodes_and_events(journal: Journal) -> None:
    journal.upsert_job("100", user="alice", mode="aware", state="running", gen=2, nodes=["n1", "n5"])
    assert [(j.job_id, j.gen, j.nodes) for j in journal.jobs()] == [("100", 2, ["n1", "n5"])]
    journal.end_job("100", "completed")
    assert journal.jobs() == [] and journal.jobs(active_only=False)[0].state == "completed"
    with pytest.raises(JournalError, match="job 7 is not in the journal"):
        journal.end_job("7", "completed")

    journal.set_node("n5", role="spare", state="free")
    journal.set_node("n1", role="compute", state="in_job", job_id="100")
    journal.set_node("n5", role="spare", state="taken", job_id="100", detail={"since_gen": 2})
    assert [(n.name, n.state, n.job_id) for n in journal.nodes(role="spare")] == [("n5", "taken", "100")]
    assert len(journal.nodes()) == 2

    first = journal.add_event("node.drain_seen", job_id="100", detail={"node": "n2"})
    journal.add_event("spare.added", detail={"node": "n6"})
    assert [e.event for e in journal.events()] == ["node.drain_seen", "spare.added"]
    assert [e.event for e in journal.events(after=first)] == ["spare.added"]
    assert [e.detail for e in journal.events(job_id="100")] == [{"node": "n2"}]


def test_journal_file_is_private_and_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(JournalError, match="schema version 99"):
        Journal(path)


WRITER = """
import sys
from torchpassd.journal import Journal, RUNNING
j = Journal(sys.argv[1])
j.upsert_job("1", user="u", mode="aware", state="running", gen=1, nodes=["n1"])
mid = j.start_migration("1", mode="planned-aware", source="n1", reason="r", gen=1)
print(mid, flush=True)
i = 0
while True:
    j.record_transition(mid, f"phase{i}", RUNNING, {"i": i})
    print(i, flush=True)
    i += 1
"""


@pytest.mark.faults
def test_nothing_committed_is_lost_to_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        mid = proc.stdout.readline().strip()
        deadline = time.monotonic() + 30
        acked = -1
        while acked < 50 and time.monotonic() < deadline:
            acked = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the writer never stops on its own
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert acked >= 50, "the writer did not get going"
    with Journal(path) as j:
        m = j.in_flight()[0]
        assert m.id == mid
        recorded = [p.detail["i"] for p in m.phases[1:]]
        assert recorded == list(range(len(recorded)))  # a prefix, no holes
        assert len(recorded) > acked  # every transition reported as committed is there
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchall() == [("ok",)]
