"""torchpassd's durable journal: SQLite in WAL mode with jobs, nodes (spares included),
migrations with one row per phase transition (timed), and an event log. Every write is one
transaction with a full fsync, so a SIGKILL or power cut loses nothing committed. The calls are
blocking (a few ms): async code runs them with ``asyncio.to_thread``. Decisions live elsewhere."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from torchpass_common import log
from torchpass_common.errors import TorchPassError

SCHEMA_VERSION = 2
RUNNING, SUCCEEDED, FAILED, ROLLED_BACK = "running", "succeeded", "failed", "rolled_back"
STATUSES = frozenset({RUNNING, SUCCEEDED, FAILED, ROLLED_BACK})
TERMINAL = frozenset({SUCCEEDED, FAILED, ROLLED_BACK})

# Schema version -> what turns the version before it into it (a new journal runs them all).
_UPGRADES = {
    2: """CREATE TABLE grants (
    reservation TEXT NOT NULL, user TEXT NOT NULL, job_id TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (reservation, user, job_id));""",
}

_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, user TEXT NOT NULL, mode TEXT NOT NULL, state TEXT NOT NULL,
    gen INTEGER NOT NULL, nodes TEXT NOT NULL, detail TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, ended REAL);
CREATE TABLE nodes (
    name TEXT PRIMARY KEY, role TEXT NOT NULL, state TEXT NOT NULL, job_id TEXT,
    detail TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE migrations (
    id TEXT PRIMARY KEY, job_id TEXT NOT NULL REFERENCES jobs(job_id), mode TEXT NOT NULL,
    source TEXT NOT NULL, target TEXT, reason TEXT NOT NULL, gen INTEGER NOT NULL,
    phase TEXT NOT NULL, status TEXT NOT NULL, error TEXT, started REAL NOT NULL, ended REAL);
CREATE INDEX migrations_by_job ON migrations(job_id, started);
CREATE INDEX migrations_by_status ON migrations(status);
CREATE TABLE phases (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, migration_id TEXT NOT NULL REFERENCES migrations(id),
    phase TEXT NOT NULL, status TEXT NOT NULL, detail TEXT NOT NULL, at REAL NOT NULL,
    seconds REAL NOT NULL);
CREATE INDEX phases_by_migration ON phases(migration_id, seq);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, event TEXT NOT NULL,
    job_id TEXT, migration_id TEXT, detail TEXT NOT NULL);
CREATE INDEX events_by_job ON events(job_id, seq);
""" + "".join(f"{step}\n" for step in _UPGRADES.values())


class JournalError(TorchPassError):
    """The journal could not be opened, read or written, or was asked something inconsistent."""


@dataclass(frozen=True)
class JobAfter:
    """A job's generation and nodes as a migration's last phase leaves them."""

    gen: int
    nodes: list[str]


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    user: str
    mode: str
    state: str
    gen: int
    nodes: list[str]
    detail: dict[str, Any]
    created: float
    updated: float
    ended: float | None


@dataclass(frozen=True)
class NodeRecord:
    name: str
    role: str
    state: str
    job_id: str | None
    detail: dict[str, Any]
    updated: float


@dataclass(frozen=True)
class PhaseRecord:
    """One transition: the migration entered ``phase`` with ``status``; ``seconds`` is the time
    spent since the previous transition (i.e. in the previous phase), 0 for the first."""

    phase: str
    status: str
    detail: dict[str, Any]
    at: float
    seconds: float


@dataclass(frozen=True)
class MigrationRecord:
    id: str
    job_id: str
    mode: str
    source: str
    target: str | None
    reason: str
    gen: int
    phase: str
    status: str
    error: str | None
    started: float
    ended: float | None
    phases: list[PhaseRecord] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        """Wall time from start to end; None while in flight."""
        return None if self.ended is None else self.ended - self.started


@dataclass(frozen=True)
class EventRecord:
    seq: int
    at: float
    event: str
    job_id: str | None
    migration_id: str | None
    detail: dict[str, Any]


def _dumps(detail: dict[str, Any] | None) -> str:
    try:
        return json.dumps(detail or {}, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise JournalError(f"detail is not JSON-serialisable: {exc}",
                           hint="pass plain str/int/float/bool/list/dict values") from exc


class Journal:
    """One open journal database. Thread-safe: one connection behind a lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            fresh = not self.path.exists()
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            if fresh:
                os.chmod(self.path, 0o600)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise JournalError(f"journal {self.path}: SQLite refused WAL mode (got {mode!r})",
                                   hint="put orchestrator.state_dir on a local filesystem, not NFS")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc}",
                               hint="check orchestrator.state_dir exists and is writable by torchpassd") from exc
        self._lock = threading.Lock()
        self._migrate_schema()

    def _migrate_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JournalError(f"journal {self.path} has schema version {version}, this torchpassd knows "
                               f"{SCHEMA_VERSION}", hint="run the newer torchpassd that wrote it, or move the file away")
        if version == SCHEMA_VERSION:
            return
        script = _SCHEMA if version == 0 else "".join(_UPGRADES[v] for v in range(version + 1, SCHEMA_VERSION + 1))
        try:  # one script, one transaction: a crash mid-way leaves the journal as it was, not half a schema
            self._db.executescript(f"BEGIN IMMEDIATE; {script} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise JournalError(f"cannot bring the journal schema in {self.path} to version {SCHEMA_VERSION}: "
                               f"{exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed (and fsynced) on success, rolled back on any error."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield self._db
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise JournalError(f"journal {self.path}: {exc}",
                                   hint="check disk space and permissions of orchestrator.state_dir") from exc
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise JournalError(f"journal {self.path}: {exc}") from exc

    # ------------------------------------------------------------ jobs and nodes

    def upsert_job(self, job_id: str, *, user: str, mode: str, state: str, nodes: list[str],
                   gen: int | None = None, detail: dict[str, Any] | None = None) -> None:
        """Create or update a tracked job (its membership, generation and state). ``gen`` None
        keeps a known job's generation (1 for a new one): only a migration's last phase moves it,
        so a Slurm update read before that phase cannot undo it."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,NULL) ON CONFLICT(job_id) DO UPDATE SET "
                "user=excluded.user, mode=excluded.mode, state=excluded.state, gen=COALESCE(?, jobs.gen), "
                "nodes=excluded.nodes, detail=excluded.detail, updated=excluded.updated",
                (job_id, user, mode, state, gen or 1, json.dumps(nodes), _dumps(detail), now, now, gen))

    def end_job(self, job_id: str, state: str) -> None:
        """Mark a job finished (completed, cancelled, failed); it stays for history."""
        now = time.time()
        with self._tx() as db:
            if db.execute("UPDATE jobs SET state=?, updated=?, ended=? WHERE job_id=?",
                          (state, now, now, job_id)).rowcount == 0:
                raise JournalError(f"job {job_id} is not in the journal", job=job_id)

    def jobs(self, *, active_only: bool = True) -> list[JobRecord]:
        where = "WHERE ended IS NULL" if active_only else ""
        rows = self._query(f"SELECT * FROM jobs {where} ORDER BY created")
        return [JobRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]), *r[7:])
                for r in rows]

    def set_node(self, name: str, *, role: str, state: str, job_id: str | None = None,
                 detail: dict[str, Any] | None = None) -> None:
        """Record a node's role (``spare`` or ``compute``), state and the job it serves."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?)",
                       (name, role, state, job_id, _dumps(detail), time.time()))

    def nodes(self, *, role: str | None = None) -> list[NodeRecord]:
        rows = (self._query("SELECT * FROM nodes WHERE role=? ORDER BY name", (role,)) if role
                else self._query("SELECT * FROM nodes ORDER BY name"))
        return [NodeRecord(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]

    # ------------------------------------------------------------ reservation grants

    def grant_opened(self, reservation: str, user: str, job_id: str) -> None:
        """``user`` is about to be let into spare reservation ``reservation`` for job ``job_id``
        (written before Slurm is asked, so a crash leaves a grant to revoke, never an unknown one)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO grants VALUES (?,?,?,?)", (reservation, user, job_id, time.time()))

    def grant_closed(self, reservation: str, user: str, job_id: str) -> None:
        """The grant was revoked in Slurm."""
        with self._tx() as db:
            db.execute("DELETE FROM grants WHERE reservation=? AND user=? AND job_id=?", (reservation, user, job_id))

    def open_grants(self) -> list[tuple[str, str, str]]:
        """Grants not (known to be) revoked: (reservation, user, job id), oldest first."""
        return [tuple(r) for r in self._query("SELECT reservation, user, job_id FROM grants ORDER BY at")]

    # ------------------------------------------------------------ migrations

    def start_migration(self, job_id: str, *, mode: str, source: str, reason: str, gen: int,
                        target: str | None = None, phase: str = "requested",
                        migration_id: str | None = None) -> str:
        """Open a migration of ``job_id`` off ``source`` and record its first phase; returns its id."""
        mid = migration_id or uuid.uuid4().hex
        now = time.time()
        with self._tx() as db:
            if db.execute("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)).fetchone() is None:
                raise JournalError(f"cannot start a migration of unknown job {job_id}", job=job_id,
                                   hint="record the job with upsert_job first")
            db.execute("INSERT INTO migrations VALUES (?,?,?,?,?,?,?,?,?,NULL,?,NULL)",
                       (mid, job_id, mode, source, target, reason, gen, phase, RUNNING, now))
            db.execute("INSERT INTO phases (migration_id, phase, status, detail, at, seconds) "
                       "VALUES (?,?,?,?,?,0)", (mid, phase, RUNNING, _dumps({"reason": reason}), now))
        log.get(job=job_id, migration=mid, gen=gen).info("journal.migration_started", mode=mode, source=source)
        return mid

    def record_transition(self, migration: str, phase: str, status: str,
                          detail: dict[str, Any] | None = None, *, target: str | None = None,
                          error: str | None = None, job_after: JobAfter | None = None) -> PhaseRecord:
        """The migration entered ``phase``; ``status`` is running, or a terminal outcome
        (succeeded, failed, rolled_back) which closes it. ``target`` records the chosen spare;
        ``job_after``, the job's generation and nodes from then on, written in the same transaction
        (a crash never leaves a finished migration with the job in its old generation)."""
        if status not in STATUSES:
            raise JournalError(f"unknown migration status {status!r}", migration=migration,
                               hint=f"use one of {sorted(STATUSES)}")
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT status, job_id FROM migrations WHERE id=?", (migration,)).fetchone()
            if row is None:
                raise JournalError(f"unknown migration {migration}", migration=migration)
            if row[0] in TERMINAL:
                raise JournalError(f"migration already ended as {row[0]}; cannot enter phase {phase}",
                                   migration=migration, job=row[1])
            last = db.execute("SELECT MAX(at) FROM phases WHERE migration_id=?", (migration,)).fetchone()[0]
            seconds = max(0.0, now - last)
            db.execute("INSERT INTO phases (migration_id, phase, status, detail, at, seconds) VALUES (?,?,?,?,?,?)",
                       (migration, phase, status, _dumps(detail), now, seconds))
            db.execute("UPDATE migrations SET phase=?, status=?, target=COALESCE(?, target), "
                       "error=COALESCE(?, error), ended=? WHERE id=?",
                       (phase, status, target, error, now if status in TERMINAL else None, migration))
            if job_after is not None:
                db.execute("UPDATE jobs SET gen=?, nodes=?, updated=? WHERE job_id=?",
                           (job_after.gen, json.dumps(job_after.nodes), now, row[1]))
        return PhaseRecord(phase, status, detail or {}, now, seconds)

    def _migrations(self, where: str, args: tuple[Any, ...]) -> list[MigrationRecord]:
        rows = self._query(f"SELECT * FROM migrations {where}", args)
        result = []
        for r in rows:
            phases = [PhaseRecord(p[0], p[1], json.loads(p[2]), p[3], p[4]) for p in self._query(
                "SELECT phase, status, detail, at, seconds FROM phases WHERE migration_id=? ORDER BY seq", (r[0],))]
            result.append(MigrationRecord(*r, phases=phases))
        return result

    def migration(self, migration: str) -> MigrationRecord:
        found = self._migrations("WHERE id=?", (migration,))
        if not found:
            raise JournalError(f"unknown migration {migration}", migration=migration,
                               hint="torchpassctl history lists the known ones")
        return found[0]

    def in_flight(self) -> list[MigrationRecord]:
        """Migrations not yet ended: what a restarted torchpassd must finish or roll back."""
        return self._migrations("WHERE status=? ORDER BY started", (RUNNING,))

    def history(self, *, job_id: str | None = None, limit: int = 50) -> list[MigrationRecord]:
        """Most recent migrations first, with their phase timings."""
        if job_id is None:
            return self._migrations("ORDER BY started DESC LIMIT ?", (limit,))
        return self._migrations("WHERE job_id=? ORDER BY started DESC LIMIT ?", (job_id, limit))

    # ------------------------------------------------------------ events

    def add_event(self, event: str, *, job_id: str | None = None, migration_id: str | None = None,
                  detail: dict[str, Any] | None = None) -> int:
        """Append to the event log (``area.thing`` names, as in the logs); returns its sequence."""
        with self._tx() as db:
            cur = db.execute("INSERT INTO events (at, event, job_id, migration_id, detail) VALUES (?,?,?,?,?)",
                             (time.time(), event, job_id, migration_id, _dumps(detail)))
            return int(cur.lastrowid or 0)

    def events(self, *, job_id: str | None = None, after: int = 0, limit: int = 200) -> list[EventRecord]:
        """Events with a sequence above ``after``, oldest first."""
        if job_id is None:
            rows = self._query("SELECT * FROM events WHERE seq>? ORDER BY seq LIMIT ?", (after, limit))
        else:
            rows = self._query("SELECT * FROM events WHERE job_id=? AND seq>? ORDER BY seq LIMIT ?",
                               (job_id, after, limit))
        return [EventRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]
