"""pytest plugin for the real dev cluster (contrib/devcluster/devcluster). Tests marked `slurm`
(or requesting the fixture) get the session fixture `devcluster`: instance $TORCHPASS_DEVCLUSTER_ID
(default 0) with 5 nodes, the last one in the `torchpass_spares` reservation, taken down at the end
of the session unless TORCHPASS_DEVCLUSTER_KEEP=1. DevCluster wraps Slurm clients and fault tools."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from torchpass_common.errors import SlurmError

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "contrib" / "devcluster" / "devcluster"
ID_ENV = "TORCHPASS_DEVCLUSTER_ID"
KEEP_ENV = "TORCHPASS_DEVCLUSTER_KEEP"
DIR_ENV = "TORCHPASS_DEVCLUSTER_DIR"
FINAL_JOB_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                    "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def instance_id_from_env() -> int:
    """The instance this session uses: $TORCHPASS_DEVCLUSTER_ID, default 0."""
    return int(os.environ.get(ID_ENV, "0"))


class DevCluster:
    """One dev cluster instance, driven through the devcluster tool and the Slurm clients."""

    def __init__(self, instance_id: int, nodes: int = 5, spares: int = 1) -> None:
        self.id = instance_id
        self.nodes = nodes
        self.spares = spares
        self.env = dict(os.environ, **{ID_ENV: str(instance_id)})
        if instance_id != instance_id_from_env():  # a second instance never shares the first one's directory
            self.env.pop(DIR_ENV, None)

    # ---- the devcluster tool ---------------------------------------------------------------
    def tool(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `devcluster ARGS` for this instance; raise SlurmError with its output if it fails."""
        res = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                             env=self.env, timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"`devcluster {' '.join(args)}` failed with status {res.returncode}: "
                             f"{res.stderr.strip() or res.stdout.strip()}", hint="see `devcluster status`")
        return res

    def up(self) -> None:
        # Each stage of `up` has its own 30 s bound; this only catches a hung tool.
        self.tool("up", "--nodes", str(self.nodes), "--spares", str(self.spares), timeout=300)

    def down(self) -> None:
        self.tool("down")

    @property
    def info(self) -> dict[str, Any]:
        """The live `devcluster status --json` object."""
        return json.loads(self.tool("status", "--json", check=False).stdout)

    @functools.cached_property
    def _layout(self) -> dict[str, Any]:
        """The parts of the status that never change for an instance (paths, ports)."""
        return self.info

    @property
    def slurm_conf(self) -> str:
        return self._layout["slurm_conf"]

    @property
    def slurm_env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF pointing at the cluster."""
        return dict(self.env, SLURM_CONF=self.slurm_conf)

    @property
    def jobs_dir(self) -> Path:
        return Path(self._layout["jobs_dir"])

    def node_pids(self, node: str) -> list[int]:
        """The processes inside ``node``'s network namespace (its slurmd, steps and their tasks)."""
        ns = next(n["netns"] for n in self.info["nodes"] if n["name"] == node)  # the tool names it
        out = self.run("ip", "netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: str) -> None:
        self.tool("kill-node", node)

    def start_node(self, node: str) -> None:
        self.tool("start-node", node)

    def cut(self, node: str) -> None:
        self.tool("cut", node)

    def heal(self, node: str) -> None:
        self.tool("heal", node)

    def link_down(self, node: str, iface: str) -> None:
        """Take one of the node's paths down (eth0 management, eth1 compute fabric)."""
        self.tool("link-down", node, iface)

    def link_up(self, node: str, iface: str) -> None:
        self.tool("link-up", node, iface)

    def link_flap(self, node: str, iface: str, period: float, duration: float) -> subprocess.Popen[str]:
        """Start flapping the node's path (down half of each period) for ``duration`` seconds; the
        process ends with the link up."""
        return subprocess.Popen([sys.executable, str(TOOL), "link-flap", node, iface, "--period", str(period),
                                 "--for", str(duration)], env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def shape(self, node: str, gbit: float, port_groups: Sequence[Sequence[int]] = ()) -> None:
        """Limit the node's link to ``gbit`` Gbit/s each way (0: unlimited); with ``port_groups``, a
        link of ``gbit`` out of the node for each group of destination ports instead."""
        self.tool("shape", node, str(gbit), *(a for g in port_groups for a in ("--ports", ",".join(map(str, g)))))

    def reset(self) -> None:
        """No jobs, every node healed, running, resumed and idle, spare reservation restored."""
        self.tool("reset")

    # ---- Slurm clients and node commands ----------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sinfo, scontrol, sbatch...) against this cluster."""
        res = subprocess.run(list(argv), capture_output=True, text=True, env=self.slurm_env,
                             timeout=timeout, cwd=cwd)
        if check and res.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed with status {res.returncode}: "
                             f"{res.stderr.strip() or res.stdout.strip()}")
        return res

    def exec(self, node: str, argv: Sequence[str], check: bool = True,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``node`` (its network, hostname and /etc/hosts)."""
        res = self.tool("exec", node, "--", *argv, check=False, timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed with status {res.returncode}: "
                             f"{res.stderr.strip() or res.stdout.strip()}", node=node)
        return res

    def sbatch(self, script_text: str, *args: str) -> str:
        """Submit a batch script (output in jobs_dir/slurm-<id>.out); returns the job id."""
        jobs = self.jobs_dir
        script = jobs / f"job-{uuid.uuid4().hex[:8]}.sh"
        script.write_text(script_text)
        out = self.run("sbatch", "--parsable", "-o", str(jobs / "slurm-%j.out"), *args, str(script),
                       cwd=jobs).stdout
        return out.strip().split(";")[0]

    def job_output(self, job: str) -> str:
        return (self.jobs_dir / f"slurm-{job}.out").read_text()

    def job_record(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job).stdout
        return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)

    def wait_job_state(self, job: str, states: str | Sequence[str], timeout: float = 30) -> str:
        """Poll until the job is in one of ``states``; fails at once if it ends in another state."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_record(job).get("JobState", "?")
            if state in wanted:
                return state
            if state in FINAL_JOB_STATES:
                raise SlurmError(f"job ended {state}, expected {'/'.join(sorted(wanted))}", job=job)
            if time.monotonic() > deadline:
                raise SlurmError(f"job still {state} after {timeout} s, expected {'/'.join(sorted(wanted))}",
                                 job=job)
            time.sleep(0.1)

    def node_state(self, node: str) -> str:
        """Slurm's state word for the node as sinfo prints it (idle, mixed, draining, down*...)."""
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.split()[0]

    def wait_node_state(self, node: str, states: str | Sequence[str], timeout: float = 30) -> str:
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while (state := self.node_state(node)) not in wanted:
            if time.monotonic() > deadline:
                raise SlurmError(f"node still {state} after {timeout} s, expected {'/'.join(sorted(wanted))}",
                                 node=node)
            time.sleep(0.1)
        return state

    def drain(self, node: str, reason: str = "torchpass test") -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")

    def clear_stale_allocation(self, node: str, why: str) -> None:
        """Slurm 22.05 can keep a node that died inside a resized job allocated or completing
        without any job once its slurmd is back; down, resume and a reconfigure clear that."""
        self.run("scontrol", "update", f"nodename={node}", "state=down", f"reason={why}")
        self.resume(node)
        self.run("scontrol", "reconfigure")


@pytest.fixture(scope="session")
def devcluster() -> Iterator[DevCluster]:
    """The session's dev cluster: 5 nodes, 1 spare; tests call .reset() at their start."""
    if os.geteuid() != 0:
        pytest.skip("the dev cluster needs root (network namespaces, private Slurm daemons)")
    cluster = DevCluster(instance_id_from_env())
    cluster.up()
    yield cluster
    if os.environ.get(KEEP_ENV) != "1":
        cluster.down()


@pytest.fixture(autouse=True)
def _devcluster_for_slurm_tests(request: pytest.FixtureRequest) -> None:
    """A test marked `slurm` gets the cluster brought up before it runs."""
    if request.node.get_closest_marker("slurm"):
        request.getfixturevalue("devcluster")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that requests `devcluster` is a `slurm` test, so `-m "not slurm"` leaves it out."""
    for item in items:
        if "devcluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
