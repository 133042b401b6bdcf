"""End-to-end fixtures (a pytest plugin of the whole suite, tests/conftest.py): a torchpassd process for
the dev cluster (real Slurm, real mosquitto), its config, a client slurm.conf with the TorchPass
cli_filter (so sbatch --torchpass marks jobs as a site install does), and helpers that submit the
example training job and watch migrations. Used by tests/e2e, tests/faults and the dev-cluster
integration tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.devcluster import DevCluster
from torchpass_common.config import derive
from torchpass_common.errors import TorchPassError
from torchpassd.ctl_client import DaemonClient
from torchpassd.drill import EXAMPLE
from torchpassd.drill_report import read_log

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = ("succeeded", "failed", "rolled_back")
CALL_FAILED = pytest.StashKey[bool]()
# Short decision timeouts so a failure shows within a test; they must still nest.
TIMEOUTS = {"collective": 10.0, "step": 20.0, "reform": 30.0, "decision": 90.0}


def install_site_config(cluster: DevCluster, config: Path) -> None:
    """Make ``config`` the dev cluster's site torchpass.toml, the file the SPANK plugin hands every
    task of a --torchpass job (plugstack.conf ``config=``), as an operator edits /etc/torchpass."""
    site = Path(cluster.info["torchpass_config"])
    if site != config:
        site.write_text(config.read_text())


def wait_until(what: str, check: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Remember whether a test's body failed, so that its torchpassd fixture can show why."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture
def criu() -> None:
    """Skip, saying why, where no working criu (4.2 or newer) is installed."""
    from criu_hooks import locate
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory, devcluster: DevCluster) -> Path:
    """A directory the nodes can read and write (the dev cluster shares this machine's disk)."""
    d = devcluster.jobs_dir / f"e2e-{os.getpid()}"
    d.mkdir(mode=0o755, exist_ok=True)
    return d


@pytest.fixture
def workdir(e2e_dir: Path, request: pytest.FixtureRequest) -> Path:
    """A clean directory for one test (its job script, training log, references)."""
    d = e2e_dir / request.node.name
    d.mkdir(mode=0o755, exist_ok=True)
    (d / "train.log").unlink(missing_ok=True)
    return d


@pytest.fixture(scope="session")
def tp_config(devcluster: DevCluster, e2e_dir: Path) -> Path:
    """torchpass.toml for this dev cluster, written as `make demo` writes it: its slurm_conf is a
    client slurm.conf that includes the cluster's and enables the TorchPass cli_filter."""
    subprocess.run(["make", "-s", "-C", str(ROOT / "spank")], check=True, timeout=120)
    assert "CliFilterPlugins=cli_filter/lua" in Path(devcluster.slurm_conf).read_text()
    client_conf = e2e_dir / "slurm.conf"
    client_conf.write_text(f"include {devcluster.slurm_conf}\nCliFilterPlugins=cli_filter/lua\n")
    lua = e2e_dir / "cli_filter.lua"
    if not lua.exists():
        lua.symlink_to(ROOT / "spank" / "cli_filter.lua")
    path = e2e_dir / "torchpass.toml"
    site = Path(devcluster.info["torchpass_config"]).read_text()  # the broker with accounts and TLS
    path.write_text(derive(site, {
        "slurm": {"slurm_conf": str(client_conf), "backend": "commands", "poll_interval": 0.5},
        "orchestrator": {"state_dir": str(e2e_dir / "state"), "control_socket": str(e2e_dir / "tpd.sock")},
        "timeouts": TIMEOUTS}))
    return path


class Daemon:
    """One torchpassd process under test (started and stopped by PID)."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = DaemonClient(config.parent / "tpd.sock", timeout=10)

    def start(self) -> None:
        env = dict(os.environ, TORCHPASS_LOG_JSON="1")
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([str(Path(sys.executable).parent / "torchpassd"), "--config", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_until("torchpassd to answer", self._answers, 60)

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"torchpassd exited with {self.proc.returncode}; see {self.log_path}")
        try:
            self.client.call("status")
        except TorchPassError:
            return False
        return True

    def complaints(self, lines: int = 60, width: int = 800) -> str:
        """The last ``lines`` warning and error lines of its log, each cut at ``width`` characters."""
        if not self.log_path.exists():
            return "(no log)"
        bad = [ln[:width] for ln in self.log_path.read_text(errors="replace").splitlines()
               if '"level": "warning"' in ln or '"level": "error"' in ln or "Traceback" in ln]
        return "\n".join(bad[-lines:]) or "(none)"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def call(self, op: str, **args: Any) -> Any:
        return self.client.call(op, **args)

    def job(self, job: str) -> dict[str, Any] | None:
        return next((j for j in self.call("jobs") if j["job"] == job), None)

    def migrations(self, job: str) -> list[dict[str, Any]]:
        """The job's migrations, oldest first."""
        return list(reversed(self.call("history", job=job)))

    def wait_migration(self, job: str, source: str, timeout: float = 240,
                       statuses: tuple[str, ...] = TERMINAL, skip: int = 0) -> dict[str, Any]:
        """The first migration off ``source`` (after ``skip`` earlier ones) to reach ``statuses``."""
        def found() -> dict[str, Any] | None:
            ms = [m for m in self.migrations(job) if m["source"] == source][skip:]
            return ms[0] if ms and ms[0]["status"] in statuses else None
        return wait_until(f"a migration of job {job} off {source}", found, timeout, every=0.1)

    def wait_moved(self, job: str, source: str, timeout: float = 240) -> dict[str, Any]:
        """The transparent migration that moved ``source``'s workers: the first one off it that
        succeeded. An earlier try may only have been rolled back by a failed criu dump (criu can
        fail to seize a thread that is just ending): the workers then went on where they were, and
        torchpassd tried again. Any other end of a try fails the wait at once."""
        def found() -> dict[str, Any] | None:
            tries = [m for m in self.migrations(job) if m["source"] == source]
            ended = [m for m in tries if m["status"] not in ("running", "succeeded")]
            assert all(m["status"] == "rolled_back" and "criu dump failed" in (m["error"] or "") for m in ended), ended
            return next((m for m in tries if m["status"] == "succeeded"), None)
        return wait_until(f"a migration of job {job} to move {source}'s workers", found, timeout, every=0.1)

    def wait_phase(self, job: str, phases: tuple[str, ...], timeout: float = 240) -> dict[str, Any]:
        """The job's running migration once it has entered one of ``phases``."""
        def found() -> dict[str, Any] | None:
            return next((m for m in self.migrations(job) if m["status"] == "running" and m["phase"] in phases), None)
        return wait_until(f"job {job} to reach phase {'/'.join(phases)}", found, timeout, every=0.05)


@pytest.fixture
def torchpassd(tp_config: Path, devcluster: DevCluster, e2e_dir: Path,
               request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A fresh torchpassd (empty journal) on a reset dev cluster; stopped after the test."""
    devcluster.reset()
    state = e2e_dir / "state"
    for f in state.glob("journal.sqlite*"):
        f.unlink()
    install_site_config(devcluster, tp_config)  # the drills' jobs read it too
    daemon = Daemon(tp_config, e2e_dir / f"torchpassd-{request.node.name}.log")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        if request.node.stash.get(CALL_FAILED, False):  # what torchpassd said, in the failure's report
            print(f"---- {daemon.log_path.name}: its warnings and errors (tail) ----\n{daemon.complaints()}")
        devcluster.reset()  # no job left, drained nodes resumed, spares restored


SRUN_PYTHON = "srun-python"  # Training's launcher: one Slurm task a rank, no torchrun


class Training:
    """The example DDP job as a user submits it: ``sbatch --torchpass`` of a script whose only line is
    an unchanged ``srun torchrun``, ``nproc`` workers a node. Nothing TorchPass-specific is exported:
    the job's launchpads find the site's config where the SPANK plugin's ``config=`` points."""

    def __init__(self, cluster: DevCluster, config: Path, workdir: Path, *, steps: int, step_sleep: float,
                 nodes: int = 4, nproc: int = 1, script: Path = EXAMPLE, args: str = "", mode: str = "aware",
                 torchrun_args: str = "", cwd: Path | None = None, spares: int = 0, launcher: str = "torchrun") -> None:
        """``config``: installed as the site's torchpass.toml before the job starts; ``script`` trains
        (with ``args``; ``mode``: its --torchpass mode); ``torchrun_args``: more torchrun options;
        ``cwd``: where sbatch runs (the job's working directory), ``workdir`` by default; ``spares``:
        hot spares in the job's allocation (``sbatch -N nodes+spares --torchpass-spares``, torchrun's
        ``--nnodes $SLURM_NNODES`` as users write it); ``launcher``: how the script runs torchrun
        (``python -m torch.distributed.run``, a full path), or ``srun-python``: no torchrun, one Slurm
        task a rank (``--ntasks-per-node=nproc``, ``srun python script``, as Lightning and submitit run)."""
        self.cluster, self.steps, self.nodes, self.nproc = cluster, steps, nodes, nproc
        self.world = nodes * nproc
        self.log = workdir / "train.log"
        self.out = workdir / "slurm-%j.out"
        install_site_config(cluster, config)
        run = f"{script} {args + ' ' if args else ''}--steps {steps} --step-sleep {step_sleep} --log {self.log}\n"
        if launcher == SRUN_PYTHON:
            script = f"#!/bin/bash\n#SBATCH --ntasks-per-node={nproc}\nsrun {sys.executable} {run}"
        else:
            script = ("#!/bin/bash\n" +
                      f"srun {launcher} --nnodes {'$SLURM_NNODES' if spares else nodes} --nproc-per-node {nproc} {torchrun_args + ' ' if torchrun_args else ''}"
                      f"--rdzv-endpoint $SLURMD_NODENAME:29500 {run}")
        client_conf = [ln.split('"')[1] for ln in config.read_text().splitlines() if ln.startswith("slurm_conf")][0]
        (workdir / "train.sh").write_text(script)
        hot = [f"--torchpass-spares={spares}"] if spares else []
        res = subprocess.run(["sbatch", "--parsable", f"--torchpass={mode}", *hot, f"-N{nodes + spares}", "-o",
                              str(self.out), str(workdir / "train.sh")],
                             capture_output=True, text=True, cwd=cwd or workdir, timeout=60,
                             env=dict(cluster.env, SLURM_CONF=client_conf), check=True)
        self.job = res.stdout.strip().split(";")[0]
        self.out = workdir / f"slurm-{self.job}.out"

    def wait_running(self, daemon: Daemon, min_step: int = 3, timeout: float = 120) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            job = daemon.job(self.job)
            workers = [w for lp in (job or {}).get("launchpads", {}).values() for w in lp["workers"]]
            return job if len(workers) == self.world and min(w["step"] for w in workers) >= min_step else None
        return wait_until(f"job {self.job} to train", ready, timeout)

    def wait_done(self, timeout: float = 240) -> tuple[list[tuple[int, int, str]], dict[int, str]]:
        """Until every rank logged its final hash; returns the log."""
        def done() -> bool:
            return self.log.exists() and len(read_log(self.log)[1]) == self.world
        wait_until(f"job {self.job} to finish training", done, timeout, every=0.5)
        return read_log(self.log)


Reference = tuple[list[tuple[int, int, str]], dict[int, str]]  # (rank, step, loss) lines, final hash per rank
_ONCE: dict[tuple[object, ...], Any] = {}
T = TypeVar("T")


def once_per_session(key: tuple[object, ...], make: Callable[[], T]) -> T:
    """``make()``'s result for ``key`` (an undisturbed run's script, layout, steps), made once per test
    session: the trainings are deterministic, so every test comparing against the same run shares it
    (each costs 20-30 s of the suite's two cores)."""
    if key not in _ONCE:
        _ONCE[key] = make()
    return _ONCE[key]


@pytest.fixture(scope="session")
def reference(e2e_dir: Path) -> Callable[..., Reference]:
    """The example training (or ``script``) without any failure (4 workers under launchpad on this
    machine), for ``steps`` steps."""
    def get(steps: int, script: Path = EXAMPLE) -> Reference:
        return read_log(reference_log(e2e_dir, 4, steps, script))
    return get


def torchrun_reference(workdir: Path, script: Path, args: str, *, nodes: int, nproc: int, steps: int) -> Reference:
    """``script`` (with ``args``) for ``steps`` steps without a failure on the layout of a job:
    ``nodes`` torchrun agents of ``nproc`` ranks on this machine (LOCAL_WORLD_SIZE as on the
    cluster), rendezvous over c10d; run once per session."""
    def run() -> Reference:
        log = workdir / f"reference-{script.stem}-{nodes}x{nproc}.log"
        log.unlink(missing_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        agents = [subprocess.Popen([torchrun, "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
                                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                    "--rdzv-id", "reference", str(script), *args.split(), "--steps", str(steps),
                                    "--log-file", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  for _ in range(nodes)]
        for agent in agents:
            _, err = agent.communicate(timeout=600)
            assert agent.returncode == 0, err[-3000:]
        return read_log(log)
    return once_per_session(("torchrun", script, args, nodes, nproc, steps), run)


def reference_log(workdir: Path, ranks: int, steps: int, script: Path = EXAMPLE, args: str = "") -> Path:
    """The example training (or ``script``, with ``args``) on ``ranks`` ranks for ``steps`` steps
    without a failure (launchpad on this machine): its log, run once per session (kept in the first
    asker's ``workdir``)."""
    def run() -> Path:
        tag = "-".join(a.lstrip("-") for a in args.split())
        log = workdir / f"reference-{script.stem}-{ranks}x{steps}{'-' + tag if tag else ''}.log"
        log.unlink(missing_ok=True)
        res = subprocess.run([sys.executable, "-m", "launchpad", "--standalone", "--nproc-per-node", str(ranks),
                              str(script), "--steps", str(steps), "--log", str(log), *args.split()],
                             timeout=600, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        return log
    return once_per_session(("launchpad", ranks, steps, script, args), run)


PROGRESS = re.compile(r"^rank (\d+) step (\d+) loss ", re.M)  # the examples' progress lines


def sacct_state(devcluster: DevCluster, job: str, timeout: float = 30) -> str:
    """``State ExitCode`` of the job as accounting has it once it ended (e.g. ``COMPLETED 0:0``);
    slurmdbd learns of the end a moment after slurmctld, so a job still RUNNING there is asked again,
    and so is one whose last record is RESIZING (a resized job's allocations before the last one are
    RESIZING; its final record follows)."""
    deadline = time.monotonic() + timeout
    while True:
        out = devcluster.run("sacct", "-X", "-n", "-P", "-j", job, "-o", "State,ExitCode").stdout
        state = " ".join(out.strip().splitlines()[-1].split("|"))
        if not state.startswith(("RUNNING", "PENDING", "RESIZING")) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def drain_a_worker_node(torchpassd: Daemon, devcluster: DevCluster, job: Training, view: dict[str, Any],
                        nproc: int) -> dict[str, Any]:
    """Drain a node of a model-aware ``job`` other than its batch host: all of its ``nproc`` ranks
    are handed over to the spare n5 in one pause, the migration succeeds, and the node is resumed.
    Returns the migration's record."""
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    assert len(moved) == nproc, view
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["ranks"]) == moved, handed  # the node's every rank, in one pause
    devcluster.resume(victim)
    return mig


def assert_every_line_once(job: Training) -> None:
    """The job's output holds each rank's progress line for each step exactly once (the moved
    ranks' lines after the migration too), and no task of the job was reported failed."""
    out = job.out.read_text()
    lines = Counter((int(r), int(s)) for r, s in PROGRESS.findall(out))
    want = {(r, s) for r in range(job.world) for s in range(job.steps)}
    assert set(lines) == want, f"missing: {sorted(want - set(lines))[:10]}"
    assert max(lines.values()) == 1, [k for k, v in lines.items() if v > 1][:10]
    assert "srun: error" not in out and "Killed" not in out, out[-2000:]


def assert_bit_identical(got: Reference, want: Reference, *,
                         killed: Collection[int] = ()) -> None:
    """Every (rank, step) loss logged exactly once and equal to the reference, same final hashes.
    ``killed``: ranks whose node was killed. A script that logs a step after its collectives
    (fsdp_train.py) loses the line of a rank killed between the step's last collective and the
    write: its rebuilt rank starts at the next step. Only that may be missing: lines of killed
    ranks, all at one step that every other rank logged."""
    steps, finals = got
    keys = [(r, s) for r, s, _ in steps]
    assert len(keys) == len(set(keys)), "a step was logged twice (re-run after the migration)"
    have, expected = {(r, s): x for r, s, x in steps}, {(r, s): x for r, s, x in want[0]}
    missing = sorted(set(expected) - set(have))
    assert {k: have[k] for k in have} == {k: expected.get(k) for k in have}, "a logged loss differs from the reference"
    died_at = {s for _, s in missing}
    assert not missing or (all(r in killed for r, _ in missing) and len(died_at) == 1), \
        f"steps missing from the log: {missing[:10]}"
    assert finals == want[1]
