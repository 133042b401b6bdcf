"""Model-transparent migration of a real gloo training rank with criu, on this host: two ranks train
a DDP model over the TorchPass default group; both park after the same step and drop their
communicator; rank 1's process tree is dumped, its images moved, restored (in a new PID namespace,
beside the stopped original), the group re-forms as generation 2 and training goes on. The losses
and final parameters must equal an uninterrupted run's, bit for bit. A failed dump and a failed
restore must each leave the original rank training. Run as a script, this file is the worker.

The test process stands in for launchpad and torchpassd: it hosts the job's TCPStore (whose keys
carry the pause step, the "paused" reports and the re-form command) and drives criu_hooks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 40
PAUSE_AT = 17
VICTIM = 1


def _criu_or_skip() -> None:
    from criu_hooks import locate
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))


class Job:
    """Two workers started the way launchpad must start them for CRIU (criu_hooks.spawn)."""

    def __init__(self, tmp: Path, *, pause_at: int, host: str = "127.0.0.1", iface: str = "lo",
                 enters: list[list[str]] | None = None) -> None:
        """``enters``: per rank, the command prefix that puts it on its node (none: this host)."""
        import torch.distributed as dist

        from criu_hooks import spawn

        self.tmp = tmp
        self.store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=60),
                                   wait_for_workers=False)
        self.store.set("pause_at", str(pause_at))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": "1"}
        self.launchers = [
            spawn.start([sys.executable, __file__, "worker", str(rank), host, str(self.store.port),
                         str(self._out(rank))], output=tmp / f"rank{rank}.log", env=env,
                        enter=enters[rank] if enters else ())
            for rank in range(WORLD)]
        self.pids = [spawn.worker_pid(p) for p in self.launchers]
        self.extra: list[subprocess.Popen[bytes]] = []  # restore supervisors

    def _out(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.jsonl"

    def wait_paused(self, timeout: float = 120.0) -> None:
        self.store.wait([f"paused/{r}" for r in range(WORLD)], timedelta(seconds=timeout))

    def reform(self, gen: int) -> None:
        for rank in range(WORLD):
            self.store.set(f"action/{rank}", f"reform {gen}")

    def results(self, timeout: float = 120.0) -> list[list[dict]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [self._rows(r) for r in range(WORLD)]
            if all(r and "final" in r[-1] for r in rows):
                return rows
            time.sleep(0.05)
        logs = {r: (self.tmp / f"rank{r}.log").read_text()[-2000:] for r in range(WORLD)}
        raise AssertionError(f"training did not finish within {timeout} s; worker output: {logs}")

    def _rows(self, rank: int) -> list[dict]:
        path = self._out(rank)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def cleanup(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in [*self.launchers, *self.extra]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def job_factory(tmp_path: Path):
    jobs: list[Job] = []

    def make(name: str, pause_at: int, **placement) -> Job:
        d = tmp_path / name
        d.mkdir()
        jobs.append(Job(d, pause_at=pause_at, **placement))
        return jobs[-1]

    yield make
    for job in jobs:
        job.cleanup()


class Reference:
    """An uninterrupted run with the same seeds; it trains while the first test's job starts."""

    def __init__(self, tmp: Path) -> None:
        self.job = Job(tmp, pause_at=0)
        self._rows: list[list[dict]] | None = None

    def rows(self) -> list[list[dict]]:
        if self._rows is None:
            self._rows = self.job.results()
        return self._rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    _criu_or_skip()
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    ref.job.cleanup()


def _same_training(got: list[list[dict]], reference: Reference) -> None:
    want = reference.rows()
    for rank in range(WORLD):
        assert [(r.get("step"), r.get("loss"), r.get("final")) for r in got[rank]] == \
               [(r.get("step"), r.get("loss"), r.get("final")) for r in want[rank]], f"rank {rank} differs"


def _pids(rows: list[dict]) -> set[int]:
    return {r["pid"] for r in rows if "pid" in r}


pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(300)]


def test_check_names_the_chosen_criu() -> None:
    _criu_or_skip()
    out = subprocess.run([sys.executable, "-m", "criu_hooks", "check", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    major, minor = map(int, report["version"].split(".")[:2])
    assert (major, minor) >= (4, 2)
    assert any(c["path"] == report["chosen"] and c["ok"] for c in report["candidates"])


def _move_victim(job: Job, tmp_path: Path, *, source: Sequence[str] = (), target: Sequence[str] = (),
                 pages_to: str | None = None) -> dict:
    """Dump the paused victim (criu inside ``source``'s namespaces), move its images (the memory
    pages through a criu page server at ``pages_to`` inside ``target`` when given), restore it
    inside ``target``'s namespaces, discard the original and re-form as generation 2."""
    from criu_hooks import runner

    victim, moved = job.pids[VICTIM], tmp_path / "target"
    server = None
    if pages_to:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        server = runner.PageServer(moved, pages_to, port, enter=target)
    try:
        dumped = runner.dump(victim, tmp_path / "images", enter=source, where={"rank": VICTIM, "gen": 1},
                             page_server=(pages_to, port) if server else None)
        streamed = server.wait() if server else 0
    finally:
        if server:
            server.stop()
    t0 = time.monotonic()
    shutil.copytree(dumped.images, moved, dirs_exist_ok=True)  # the wormhole's job, later
    transfer_s = time.monotonic() - t0
    supervisor = subprocess.Popen([*target, sys.executable, "-m", "criu_hooks", "restore", str(moved)],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
    job.extra.append(supervisor)
    restored = json.loads(supervisor.stdout.readline())
    assert "pid" in restored, restored
    runner.discard_original(victim)
    job.pids[VICTIM] = restored["pid"]
    job.reform(2)
    return {"dump_s": round(dumped.seconds, 3), "frozen_s": round(dumped.frozen_seconds or -1, 3),
            "image_mb": round(dumped.image_bytes / 1e6, 1), "page_server_mb": round(streamed / 1e6, 1),
            "transfer_s": round(transfer_s, 3), "restore_s": round(restored["seconds"], 3)}


def _victim_rows(got: list[list[dict]], key: str) -> tuple[object, object]:
    """``key`` of the victim's last step before the pause and its first after it."""
    return tuple(next(r[key] for r in got[VICTIM] if r.get("step") == s) for s in (PAUSE_AT - 1, PAUSE_AT))


def test_rank_moves_by_dump_and_restore_and_trains_on_bit_identical(job_factory, reference, tmp_path) -> None:
    job = job_factory("migrated", PAUSE_AT)
    job.wait_paused()
    timings = _move_victim(job, tmp_path)
    got = job.results()

    _same_training(got, reference)
    before, after = _victim_rows(got, "pid")
    assert before != after, "rank 1 was expected to run on in the restored process"
    assert job.extra[0].wait(timeout=30) == 0  # the restore supervisor exits as the worker did
    print(json.dumps({"same_host": timings}))


def test_rank_moves_to_the_spare_node_with_pages_streamed_by_criu(devcluster, job_factory, reference, tmp_path) -> None:
    devcluster.reset()
    info = devcluster.info
    workers = [n for n in info["nodes"] if not n["spare"]][:2]
    spare = next(n for n in info["nodes"] if n["spare"])

    def on(node: dict) -> list[str]:  # the node's network namespace only: criu then runs in the same
        return ["nsenter", f"--net=/run/netns/{node['netns']}"]

    job = job_factory("cross_node", PAUSE_AT, host=info["broker"]["host"], iface="eth0",
                      enters=[on(n) for n in workers])
    job.wait_paused()
    timings = _move_victim(job, tmp_path, source=on(workers[VICTIM]), target=on(spare), pages_to=spare["addr"])
    got = job.results()

    _same_training(got, reference)
    before, after = _victim_rows(got, "netns")
    assert before == os.stat(f"/run/netns/{workers[VICTIM]['netns']}").st_ino
    assert after == os.stat(f"/run/netns/{spare['netns']}").st_ino, "rank 1 must train on on the spare"
    assert timings["page_server_mb"] > 10 * timings["image_mb"], "memory must travel by the page server"
    print(json.dumps({"cross_node": timings, "from": workers[VICTIM]["name"], "to": spare["name"]}))


def test_failed_dump_leaves_the_worker_training(job_factory, reference, tmp_path) -> None:
    from criu_hooks import runner
    from criu_hooks.errors import CriuFailed

    job = job_factory("dump_fails", PAUSE_AT)
    job.wait_paused()
    victim = job.pids[VICTIM]
    # Without --tcp-close criu refuses the rank's live TCPStore connection: a real dump failure.
    with pytest.raises(CriuFailed, match=r"TCP.*\(rank=1\) - the worker was left as it was"):
        runner.dump(victim, tmp_path / "images", tcp_close=False, where={"rank": VICTIM})
    runner.resume_original(victim)
    job.reform(2)
    got = job.results()

    _same_training(got, reference)
    assert len(_pids(got[VICTIM])) == 1, "the original process must have trained on"


def test_failed_restore_lets_the_original_resume(job_factory, reference, tmp_path) -> None:
    from criu_hooks import runner

    job = job_factory("restore_fails", PAUSE_AT)
    job.wait_paused()
    victim = job.pids[VICTIM]
    dumped = runner.dump(victim, tmp_path / "images", where={"rank": VICTIM})
    moved = shutil.copytree(dumped.images, tmp_path / "target")
    for pages in moved.glob("pages-*.img"):  # a transfer that lost the memory pages
        pages.unlink()
    supervisor = subprocess.run([sys.executable, "-m", "criu_hooks", "restore", str(moved)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
    assert supervisor.returncode == 1
    assert "criu restore failed" in json.loads(supervisor.stdout)["error"]
    assert os.path.exists(f"/proc/{victim}"), "the stopped original must still be there"
    runner.resume_original(victim)
    job.reform(2)
    got = job.results()

    _same_training(got, reference)
    assert len(_pids(got[VICTIM])) == 1, "the original process must have trained on"


# ---- the worker: a plain DDP training loop; the parking at the step boundary stands in for the
# ---- bootstrap's step hook and launchpad's agent channel in --torchpass=transparent mode.

def _host_pid() -> int:
    return int(os.readlink("/proc/self"))  # /proc is the host's: its PID, not the namespace's 1


def _connect(host: str, port: int):
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=20))


def _netns() -> int:
    return os.stat("/proc/self/ns/net").st_ino  # which node this process runs on


class _Parking:
    """At the pause step: drop the communicator (no inet socket left but the store client), report
    "paused", wait for the re-form command (reconnecting the store if criu closed its socket) and
    re-form the default group in place, so DDP keeps its buckets."""

    def __init__(self, store, address: tuple[str, int], rank: int, pause_at: int) -> None:
        self.store, self.address, self.rank, self.pause_at = store, address, rank, pause_at

    def at_boundary(self, step: int) -> None:
        from torchpass import default_group

        if step != self.pause_at:
            return
        group = default_group.group()
        group.release()  # drop the gloo sockets, as torchpass.criu_park does before a dump
        self.store.set(f"paused/{self.rank}", str(step))
        gen = int(self._wait(f"action/{self.rank}").split()[1])
        group.reconfigure(gen, self.rank, WORLD, self.store, f"gen{gen}/")

    def _wait(self, key: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.store.check([key]):
                    return self.store.get(key).decode()
            except RuntimeError:  # restored by criu --tcp-close: the old connection is closed
                self.store = _connect(*self.address)
            time.sleep(0.01)
        raise TimeoutError(f"rank {self.rank}: no {key} within {timeout} s")


def _worker(rank: int, host: str, port: int, out_path: str) -> None:
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchpass import default_group, steps

    steps.install()
    default_group.install(joining=False)
    store = _connect(host, port)
    parking = _Parking(store, (host, port), rank, int(store.get("pause_at")))
    steps.on_boundary(parking.at_boundary)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store), rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    with open(out_path, "a", buffering=1) as out:
        for step in range(1, STEPS + 1):
            x, y = torch.randn(32, 64, generator=data), torch.randn(32, 8, generator=data)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            row = {"step": step, "loss": loss.item().hex(), "pid": _host_pid(), "netns": _netns()}
            out.write(json.dumps(row) + "\n")
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        out.write(json.dumps({"final": digest.hexdigest()}) + "\n")
    os._exit(0)  # no teardown collectives: the other rank may already be gone


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
