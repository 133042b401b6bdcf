"""slurm_plugin against the real dev cluster, once per backend (Slurm commands; slurmrestd with
JWT, and with local socket auth in the slurmd-kill test): watcher events for drains, admin DOWN
and a killed slurmd, the spare pool, growing a job by spares and releasing a node."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_plugin import events as ev
from slurm_plugin.client import SlurmClient
from slurm_plugin.connect import open_client, runner_for
from slurm_plugin.resize import JobResizer
from slurm_plugin.spares import SparePool
from slurm_plugin.watcher import Watcher
from tests.integration.test_slurm_spank import submit, torchpass_conf  # noqa: F401 - shared fixture
from tests.support.devcluster import DevCluster
from torchpass_common.config import SlurmConfig
from torchpass_common.errors import SlurmError

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
RESV = "torchpass_spares"


class Slurmrestd:
    """A private slurmrestd for the cluster, run as ``nobody`` (it refuses root), by PID."""

    def __init__(self, conf: str, listen: str, auth: str, extra_env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["slurmrestd", "-a", auth, listen], env=dict(os.environ, SLURM_CONF=conf, **extra_env),
            user="nobody", group="nogroup", extra_groups=[], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def rest_socket(devcluster: DevCluster) -> Iterator[str]:
    """slurmrestd with rest_auth/local on a unix socket (needs no slurm.conf change)."""
    with tempfile.TemporaryDirectory(prefix="tprest") as d:
        os.chmod(d, 0o777)
        sock = f"{d}/rest.sock"
        rest = Slurmrestd(devcluster.slurm_conf, f"unix:{sock}", "rest_auth/local", {})
        try:
            _wait(lambda: os.path.exists(sock) or rest.proc.poll() is not None, "slurmrestd's socket", 30)
            assert rest.proc.poll() is None, rest.proc.stderr.read().decode() if rest.proc.stderr else ""
            yield f"unix:{sock}"
        finally:
            rest.stop()


@pytest.fixture(scope="session")
def rest_jwt(devcluster: DevCluster) -> Iterator[str]:
    """slurmrestd with JWT on TCP; needs AuthAltTypes=auth/jwt in the cluster's slurm.conf."""
    if "auth/jwt" not in Path(devcluster.slurm_conf).read_text():
        pytest.skip("the dev cluster's slurm.conf has no AuthAltTypes=auth/jwt (JWT not configured)")
    with socket.socket() as probe:  # a free port; slurmrestd binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rest = Slurmrestd(devcluster.slurm_conf, f"127.0.0.1:{port}", "rest_auth/jwt", {"SLURM_JWT": "daemon"})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        rest.stop()


@pytest.fixture(params=["commands", "rest"])
def client(request: pytest.FixtureRequest, devcluster: DevCluster) -> SlurmClient:
    """A SlurmClient of each backend, built by the same selection code torchpassd uses. REST
    here is the production set-up (JWT over TCP); the local-socket mode is covered by the
    slurmd-kill test, which watches with both backends at once."""
    if request.param == "commands":
        cfg = SlurmConfig(backend="commands", slurm_conf=devcluster.slurm_conf)
    else:
        url = request.getfixturevalue("rest_jwt")
        cfg = SlurmConfig(backend="rest", rest_url=url, slurm_conf=devcluster.slurm_conf)
    deadline = time.monotonic() + 30
    while True:  # slurmrestd on TCP may still be starting
        try:
            return open_client(cfg)
        except SlurmError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def wait_event(watcher: Watcher, match: Callable[[ev.SlurmEvent], bool], timeout: float) -> tuple[ev.SlurmEvent, float]:
    """Poll until an event matches; returns it and the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for e in watcher.poll():
            if match(e):
                return e, time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"no matching event within {timeout} s")


def start_job(cluster: DevCluster, conf: str, nodes: str, body: str = "srun sleep 600\n", user: str = "") -> int:
    job, _ = submit(cluster, conf, body, "--torchpass", f"-N{len(nodes.split(','))}", "-w", nodes, user=user)
    cluster.wait_job_state(job, "RUNNING")
    return int(job)


def test_watcher_reports_job_drain_and_admin_down(devcluster: DevCluster, torchpass_conf: str,  # noqa: F811
                                                  client: SlurmClient) -> None:
    devcluster.reset()
    watcher = Watcher(client, interval=0.2, spare_reservation=RESV)
    watcher.poll()
    job = start_job(devcluster, torchpass_conf, "n1,n2,n3")
    started, _ = wait_event(watcher, lambda e: isinstance(e, ev.JobStarted) and e.job == job, 10)
    assert started.nodes == ("n1", "n2", "n3") and started.mode == "auto"

    devcluster.drain("n2", "ecc errors")
    drain, seconds = wait_event(watcher, lambda e: isinstance(e, ev.NodeDraining), 5)
    assert (drain.node, drain.jobs, drain.reason, drain.reason_by) == ("n2", (job,), "ecc errors", "root")
    print(f"{client.name}: drain seen after {seconds:.2f} s")
    assert seconds < 5  # one poll, even on two busy cores

    devcluster.run("scontrol", "update", "nodename=n3", "state=down", "reason=psu")
    down, seconds = wait_event(watcher, lambda e: isinstance(e, ev.NodeDown), 5)
    assert (down.node, down.jobs, down.reason) == ("n3", (job,), "psu") and seconds < 5
    print(f"{client.name}: admin DOWN seen after {seconds:.2f} s")
    assert watcher.jobs[job].nodes == ("n1", "n2")  # --no-kill: n3 left the job, the job runs on

    devcluster.resume("n2")
    wait_event(watcher, lambda e: isinstance(e, ev.NodeReturned) and e.node == "n2", 5)
    devcluster.run("scancel", str(job))
    ended, _ = wait_event(watcher, lambda e: isinstance(e, ev.JobEnded), 10)
    assert ended.job == job and ended.state in ("CANCELLED", "COMPLETING")


def test_async_watcher_streams_events(devcluster: DevCluster, torchpass_conf: str) -> None:  # noqa: F811
    """The orchestrator's way in: ``async for event in watcher.events()`` at the default 1 s."""
    devcluster.reset()
    job = start_job(devcluster, torchpass_conf, "n1,n2")
    watcher = Watcher(open_client(SlurmConfig(slurm_conf=devcluster.slurm_conf)), spare_reservation=RESV)

    async def until_drain_seen() -> list[ev.SlurmEvent]:
        seen: list[ev.SlurmEvent] = []
        async for e in watcher.events():
            seen.append(e)
            if isinstance(e, ev.JobStarted):
                await asyncio.to_thread(devcluster.drain, "n1", "async test")
            if isinstance(e, ev.NodeDraining):
                return seen
        return seen

    seen = asyncio.run(asyncio.wait_for(until_drain_seen(), timeout=15))
    assert [type(e).__name__ for e in seen] == ["JobStarted", "SpareAdded", "NodeDraining"]
    assert seen[0].job == job and seen[-1].node == "n1"


@pytest.mark.slow
@pytest.mark.faults
def test_killed_slurmd_is_seen_by_every_backend(devcluster: DevCluster, torchpass_conf: str,  # noqa: F811
                                                rest_socket: str) -> None:
    """One slurmd kill (it takes ~26 s to turn DOWN) watched by both backends at once."""
    devcluster.reset()
    clients = [open_client(SlurmConfig(backend="commands", slurm_conf=devcluster.slurm_conf)),
               open_client(SlurmConfig(backend="rest", rest_url=rest_socket, slurm_conf=devcluster.slurm_conf))]
    job = start_job(devcluster, torchpass_conf, "n1,n2")
    watchers = [Watcher(c, interval=0.5, spare_reservation=RESV) for c in clients]
    for w in watchers:
        w.poll()
    devcluster.kill_node("n2")
    t0 = time.monotonic()
    seen: dict[tuple[str, str], float] = {}
    while len(seen) < 4 and time.monotonic() - t0 < 90:  # a poll by commands can take seconds on a busy machine
        for w in watchers:
            for e in w.poll():
                if isinstance(e, ev.NodeNotResponding | ev.NodeDown) and e.node == "n2":
                    seen.setdefault((w.client.name, type(e).__name__), time.monotonic() - t0)
        time.sleep(0.5)
    print("slurmd kill -> event seconds:", {f"{k[0]}/{k[1]}": round(v, 1) for k, v in seen.items()})
    for backend in ("commands", "rest"):  # both events, from every backend, in the order Slurm sets them
        assert seen.get((backend, "NodeNotResponding"), 999) < seen.get((backend, "NodeDown"), 999) < 90, seen
    assert devcluster.job_record(str(job))["JobState"] == "RUNNING"  # --no-kill: n1 carries on


def test_spare_pool_health_and_taking(devcluster: DevCluster, client: SlurmClient) -> None:
    devcluster.reset()
    pool = SparePool(client, RESV)
    assert [(s.node, s.available) for s in pool.list()] == [("n5", True)]
    devcluster.drain("n5", "fan")
    (spare,) = pool.list()
    assert not spare.available and spare.why == "drained: fan"
    with pytest.raises(SlurmError, match=r"no usable spare in reservation 'torchpass_spares' \(n5: drained: fan\)"):
        pool.take(job=1)
    devcluster.resume("n5")  # slurmctld flags a resumed node NOT_RESPONDING until its next ping
    _wait(lambda: pool.list()[0].available, "the resumed spare to answer slurmctld")
    assert pool.take(job=1) == "n5"
    with pytest.raises(SlurmError, match="n5: taken for a migration"):
        pool.take(job=2)
    pool.give_back("n5")
    assert pool.take(job=2) == "n5"


def test_job_grows_by_two_spares_in_a_row_and_runs_tasks_there(devcluster: DevCluster, torchpass_conf: str,  # noqa: F811
                                                                client: SlurmClient) -> None:
    devcluster.reset()
    devcluster.run("scontrol", "update", f"reservationname={RESV}", "nodes=n4,n5")
    job = start_job(devcluster, torchpass_conf, "n1,n2", user="nobody")  # a user's job; we are root
    resizer = JobResizer(runner_for(SlurmConfig(slurm_conf=devcluster.slurm_conf)), client,
                         spare_reservation=RESV)
    pool = SparePool(client, RESV)
    for expected in ("n4", "n5"):
        t0 = time.monotonic()
        node = resizer.add_spare(job, pool)
        grow = time.monotonic() - t0
        assert node == expected
        step = resizer.start_step(job, node, ["bash", "-c", 'echo "$(id -un) $(hostname) $SLURM_JOB_ID $TORCHPASS"'],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = step.communicate(timeout=30)
        assert step.returncode == 0, err
        assert out.split() == ["nobody", node, str(job), "auto"]
        print(f"grew job {job} by {node} in {grow:.2f} s")
    assert client.job(job).nodes == ("n1", "n2", "n4", "n5")
    assert devcluster.job_record(str(job))["JobState"] == "RUNNING"
    assert client.reservations()[RESV].users == ("root",)  # the user was let in only for the helper
    with pytest.raises(SlurmError, match="no usable spare"):
        resizer.add_spare(job, pool)
    with pytest.raises(SlurmError, match=r"`salloc .*-w n3 .*` failed \(rc=1\): salloc: error: ") as refused:
        resizer.add_node(job, "n3")  # not a spare: Slurm refuses, and says why
    assert refused.value.where == {"job": job, "node": "n3"}
    assert client.job(job).nodes == ("n1", "n2", "n4", "n5")
    devcluster.run("scancel", str(job))  # the job ends: the spares it grew onto serve the next migration
    _wait(lambda: [s.available for s in pool.list()] == [True, True], "the ended job's spares to be free", timeout=60)
    assert pool.take(job=job + 1) == "n4"


def test_the_jobs_hot_spare_count_is_read_from_slurm(devcluster: DevCluster, torchpass_conf: str,  # noqa: F811
                                                     client: SlurmClient) -> None:
    devcluster.reset()
    job, _ = submit(devcluster, torchpass_conf, "srun -N2 -w n1,n2 sleep 600\n", "--torchpass-spares=1", "-N3",
                    "-w", "n1,n2,n3")
    devcluster.wait_job_state(job, "RUNNING")
    assert client.job(int(job)).torchpass.spares == 1


def test_drained_node_is_released_while_the_job_runs_on(devcluster: DevCluster, torchpass_conf: str,  # noqa: F811
                                                       client: SlurmClient) -> None:
    devcluster.reset()
    beats = Path(tempfile.mkdtemp(prefix="beats", dir=devcluster.jobs_dir))
    beats.chmod(0o777)
    job = start_job(devcluster, torchpass_conf, "n1,n2,n3",
                    f"srun bash -c 'while :; do date +%s.%N > {beats}/$(hostname); sleep 0.1; done'\n")
    _wait(lambda: len(list(beats.iterdir())) == 3, "a heartbeat file from every task")
    resizer = JobResizer(runner_for(SlurmConfig(slurm_conf=devcluster.slurm_conf)), client,
                         spare_reservation=RESV)
    with pytest.raises(SlurmError, match="n1 is the batch host of job"):
        resizer.release_node(job, "n1")
    for node, left in (("n3", ("n1", "n2")), ("n2", ("n1",))):  # twice: repeated resizes work
        devcluster.drain(node, "planned maintenance")
        assert resizer.release_node(job, node).nodes == left
    _wait(lambda: devcluster.node_state("n2") == "drained", "n2 to be empty")
    marks = {p.name: p.stat().st_mtime for p in beats.iterdir()}
    time.sleep(1.0)
    assert (beats / "n1").stat().st_mtime > marks["n1"]  # the remaining task still runs
    assert (beats / "n2").stat().st_mtime == marks["n2"]  # the released node's task is gone
    assert devcluster.job_record(str(job))["JobState"] == "RUNNING"


def test_torchpassctl_views(devcluster: DevCluster, torchpass_conf: str, tmp_path: Path) -> None:  # noqa: F811
    devcluster.reset()
    job = start_job(devcluster, torchpass_conf, "n1,n2")
    devcluster.drain("n2", "bad dimm")
    cfg = tmp_path / "torchpass.toml"
    cfg.write_text(f'[slurm]\nslurm_conf = "{devcluster.slurm_conf}"\n')

    def ctl(*args: str) -> dict:
        res = subprocess.run([str(ROOT / ".venv" / "bin" / "torchpassctl"), "--config", str(cfg), *args],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    jobs = ctl("jobs", "--json")
    assert jobs["backend"] == "commands" and "pyslurm" in jobs["backend_reason"]
    assert [(j["job"], j["mode"], j["nodes"]) for j in jobs["jobs"]] == [(job, "auto", "n[1-2]")]
    nodes = {n["node"]: n for n in ctl("nodes", "--json")["nodes"]}
    assert nodes["n2"]["state"] == "mixed+DRAIN" and nodes["n2"]["reason"] == "bad dimm"
    assert nodes["n2"]["jobs"] == str(job) and not nodes["n2"]["healthy"]
    assert [(s["node"], s["available"]) for s in ctl("spares", "--json")["spares"]] == [("n5", True)]
    table = subprocess.run([str(ROOT / ".venv" / "bin" / "torchpassctl"), "--config", str(cfg), "spares"],
                           capture_output=True, text=True, timeout=60).stdout
    assert table.splitlines()[0].split() == ["node", "available", "state", "why"]
