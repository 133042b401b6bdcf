"""Steps of the demo, each announced on its own line: bring up the dev cluster (5 nodes, the last
one a spare), show its status, run a 3-node sbatch job that prints each node's hostname and
address, show the job's output, run the live-migration drill (torchpassd + `torchpassctl drill`),
and leave the cluster up with the command that takes it down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "contrib" / "devcluster" / "devcluster"
JOB_TIMEOUT = 120
JOB = """#!/bin/bash
#SBATCH --job-name=hello-nodes
echo "batch script on $(hostname), job $SLURM_JOB_ID, nodes $SLURM_JOB_NODELIST"
srun bash -c 'echo "  task $SLURM_PROCID runs on $(hostname) at $(hostname -I)"'
"""


class DemoError(Exception):
    """A demo step failed; the message says which and where to look."""


def step(number: int, text: str) -> None:
    print(f"\n[demo] step {number}/5: {text}", flush=True)


def run(argv: list[str], env: dict[str, str], *, capture: bool = False, cwd: Path | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, env=env, text=True, capture_output=capture, cwd=cwd, timeout=timeout)
    if res.returncode != 0:
        raise DemoError(f"`{' '.join(map(str, argv))}` failed with status {res.returncode}")
    return res


def drill(env: dict[str, str], jobs: Path) -> None:
    """Start torchpassd for the dev cluster (by PID), run the drill with its timeline, stop it."""
    import json
    import signal
    import time

    from torchpass_common.config import derive

    info = json.loads(run([sys.executable, str(TOOL), "status", "--json"], env, capture=True).stdout)
    conf_dir = jobs / "demo-torchpass"
    conf_dir.mkdir(mode=0o755, exist_ok=True)
    client_conf = conf_dir / "slurm.conf"  # sbatch with the TorchPass cli_filter, as a site installs it
    client_conf.write_text(f"include {env['SLURM_CONF']}\nCliFilterPlugins=cli_filter/lua\n")
    if not (conf_dir / "cli_filter.lua").exists():
        (conf_dir / "cli_filter.lua").symlink_to(ROOT / "spank" / "cli_filter.lua")
    config = conf_dir / "torchpass.toml"
    site = Path(info["torchpass_config"]).read_text()  # the cluster's broker: accounts and TLS
    config.write_text(derive(site, {"slurm": {"slurm_conf": str(client_conf)},
                                    "orchestrator": {"state_dir": str(conf_dir / "state"),
                                                     "control_socket": str(conf_dir / "torchpassd.sock")}}))
    bindir = Path(sys.executable).parent
    with open(conf_dir / "torchpassd.log", "ab") as log:
        daemon = subprocess.Popen([str(bindir / "torchpassd"), "--config", str(config)], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        print(f"[demo] torchpassd pid {daemon.pid}, log {conf_dir / 'torchpassd.log'}", flush=True)
        deadline = time.monotonic() + 60
        while not (conf_dir / "torchpassd.sock").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"torchpassd did not start; see {conf_dir / 'torchpassd.log'}")
            time.sleep(0.2)
        run([str(bindir / "torchpassctl"), "--config", str(config), "drill", "--mode", "planned-aware"], env,
            timeout=900)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def main() -> int:
    env = dict(os.environ)
    tool = [sys.executable, str(TOOL)]
    step(1, "bring up the dev cluster: munge, MariaDB + slurmdbd, slurmctld, 5 slurmd nodes "
            "(one network namespace each), the torchpass_spares reservation, mosquitto")
    run([*tool, "up", "--nodes", "5", "--spares", "1"], env)

    step(2, "the cluster as `devcluster status` sees it")
    run([*tool, "status"], env)
    env.update(line.removeprefix("export ").split("=", 1)
               for line in run([*tool, "env"], env, capture=True).stdout.splitlines())

    step(3, f"submit a 3-node batch job and wait for it (at most {JOB_TIMEOUT} s)")
    jobs = Path(env["SLURM_CONF"]).parent.parent / "jobs"
    script = jobs / "demo-hello-nodes.sh"
    script.write_text(JOB)
    out = jobs / "demo-hello-nodes-%j.out"
    submitted = run(["sbatch", "--parsable", "--wait", "-N", "3", "-o", str(out), str(script)], env,
                    capture=True, cwd=jobs, timeout=JOB_TIMEOUT)
    job = submitted.stdout.strip().split(";")[0]
    print(f"[demo] job {job} completed")

    step(4, "the job's output: one task per node, each with its own hostname and address")
    print(Path(str(out).replace("%j", job)).read_text(), end="")

    step(5, "live migration drill: torchpassd runs; the example DDP job trains on 4 nodes; one node is "
            "drained and its rank moves to the spare (torchpassctl drill --mode planned-aware)")
    drill(env, jobs)

    print(f"\n[demo] done. The dev cluster is still up; use it with:\n"
          f"         eval \"$({TOOL} env)\"; sinfo; squeue\n"
          f"       take it down with:\n"
          f"         {TOOL} down", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (DemoError, subprocess.TimeoutExpired) as exc:
        print(f"[demo] FAILED: {exc}. Logs: `{TOOL} status` shows where they are.", file=sys.stderr)
        sys.exit(1)
