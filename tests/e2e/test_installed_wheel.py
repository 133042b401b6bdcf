"""TorchPass installed as an operator installs it: the wheel built from this checkout, pip-installed
with its dependencies into a fresh venv (nothing of the checkout on sys.path), runs torchpassd, the
jobs' launchpad (found on the job's PATH by the SPANK shim) and ``torchpassctl drill --mode
planned-aware`` against the dev cluster: the drill's job (shipped in the wheel) migrates, stays
bit-identical and ends COMPLETED. The SPANK plugin is the dev cluster's (``make -C spank``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.recovery import DrillDaemon
from tests.support.devcluster import DevCluster

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert res.returncode == 0, f"{argv[:4]} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the wheel and its dependencies; returns its bin directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(ROOT)], timeout=300)
    [wheel] = (tmp / "dist").glob("torchpass-*.whl")
    _run(["python3", "-m", "venv", str(tmp / "venv")], timeout=120)
    _run([str(tmp / "venv" / "bin" / "pip"), "install", "-q", str(wheel)], timeout=900)
    return tmp / "venv" / "bin"


def test_the_wheel_in_a_fresh_venv_runs_the_daemon_the_launchpads_and_a_planned_drill(
        installed: Path, devcluster: DevCluster, tmp_path: Path) -> None:
    env = {"PATH": f"{installed}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": ""}
    where = _run([str(installed / "python"), "-c", "import torchpassd, launchpad, torchpass, sys; "
                  "print(torchpassd.__file__, launchpad.__file__, torchpass.__file__, sys.path)"],
                 timeout=60, cwd="/", env={**os.environ, **env})
    assert str(ROOT) not in where.stdout and where.stdout.count(str(installed.parent)) >= 3, where.stdout
    work = devcluster.jobs_dir / f"wheel-{time.strftime('%H%M%S')}"
    work.mkdir(mode=0o755)
    daemon = DrillDaemon(devcluster, work, bindir=installed, env=env)
    try:
        drill = subprocess.Popen([str(installed / "torchpassctl"), "--config", str(work / "torchpass.toml"), "drill",
                                  "--mode", "planned-aware", "--nodes", "2", "--nproc-per-node", "2", "--steps", "200",
                                  "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                                 env={**devcluster.slurm_env, **env})
        pythons = _worker_pythons(daemon, drill)  # while the job trains: which interpreter its workers run
        out, err = drill.communicate(timeout=600)
    finally:
        daemon.stop()
    assert drill.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    rep = json.loads(out)
    assert rep["ok"] and rep["bit_identical"] and rep["job_state"] == "COMPLETED", rep
    assert rep["moved_ranks"] and len(rep["moved_ranks"]) == 2, rep
    assert pythons and all(p.startswith(str(installed.parent)) for p in pythons), pythons  # the wheel's launchpad


def _worker_pythons(daemon: DrillDaemon, drill: subprocess.Popen[str]) -> set[str]:
    """The interpreters the drill job's workers were started with, read from /proc while they train."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and drill.poll() is None:
        for job in daemon.client.call("jobs"):
            pids = [w["pid"] for lp in job.get("launchpads", {}).values() for w in lp.get("workers") or []]
            found = set()
            for pid in pids:  # argv[0]: launchpad starts workers with its own interpreter (sys.executable)
                try:
                    found.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
                except OSError:
                    continue
            if found:
                return found
        time.sleep(0.5)
    return set()
