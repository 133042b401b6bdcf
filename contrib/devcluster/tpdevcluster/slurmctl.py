"""The few Slurm client calls the dev cluster tool itself needs: controller ping, node states,
one node's record, the spare reservation, resuming nodes and cancelling jobs. (TorchPass's
own Slurm adapter lives in slurm_plugin/; this is only the cluster's housekeeping.)"""

from __future__ import annotations

import os
import subprocess

from .errors import DevClusterError
from .hostinfo import tool
from .instance import SPARE_RESERVATION, Instance


def run(inst: Instance, *argv: str, check: bool = True, timeout: float = 20) -> str:
    env = dict(os.environ, SLURM_CONF=str(inst.slurm_conf))
    try:
        res = subprocess.run([tool(argv[0]), *argv[1:]], capture_output=True, text=True,
                             env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise DevClusterError(f"`{' '.join(argv)}` did not answer within {timeout:.0f} s",
                              instance=inst.id, hint="is slurmctld up? see `devcluster status`") from exc
    if check and res.returncode != 0:
        raise DevClusterError(f"`{' '.join(argv)}` failed: {(res.stderr or res.stdout).strip()}",
                              instance=inst.id)
    return res.stdout


def ping(inst: Instance) -> bool:
    """True if slurmctld answers; a controller too busy to answer in 5 s counts as not up."""
    try:
        return "is UP" in run(inst, "scontrol", "ping", check=False, timeout=5)
    except DevClusterError:
        return False


def node_states(inst: Instance) -> dict[str, str]:
    """Slurm's state word per node as sinfo prints it (idle, allocated, draining, down*, ...)."""
    out = run(inst, "sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
    return dict(line.split(None, 1) for line in out.splitlines() if " " in line)


def allocated_cpus(inst: Instance) -> dict[str, int]:
    """CPUs the controller counts as allocated, per node (sinfo's %C is A/I/O/T)."""
    out = run(inst, "sinfo", "-h", "-N", "-o", "%N %C", check=False, timeout=10)
    return {name: int(cpus.split("/")[0]) for name, cpus in
            (line.split(None, 1) for line in out.splitlines() if " " in line)}


def node_record(inst: Instance, node: str) -> dict[str, str]:
    """`scontrol -o show node` as a dict (values with spaces, e.g. Reason, are cut at the space)."""
    out = run(inst, "scontrol", "-o", "show", "node", node, timeout=10)
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def hostnames(inst: Instance, expr: str) -> list[str]:
    if not expr or expr == "(null)":
        return []
    return run(inst, "scontrol", "show", "hostnames", expr, timeout=10).split()


def reservation_nodes(inst: Instance) -> list[str] | None:
    """Nodes of the spare reservation, or None if it does not exist."""
    out = run(inst, "scontrol", "-o", "show", "reservation", SPARE_RESERVATION, check=False, timeout=10)
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    if "Nodes" not in fields:
        return None
    return hostnames(inst, fields["Nodes"])


def ensure_reservation(inst: Instance) -> None:
    """Make the spare reservation hold exactly the last ``inst.spares`` nodes (none: no reservation)."""
    current = reservation_nodes(inst)
    want = inst.spare_names
    if current is not None and sorted(current) == sorted(want):
        return
    if current is not None:
        run(inst, "scontrol", "delete", f"reservationname={SPARE_RESERVATION}")
    if want:
        run(inst, "scontrol", "create", "reservation", f"reservationname={SPARE_RESERVATION}",
            f"nodes={','.join(want)}", "starttime=now", "duration=infinite", "users=root",
            "flags=ignore_jobs")


def resume(inst: Instance, node: str) -> None:
    run(inst, "scontrol", "update", f"nodename={node}", "state=resume")


def job_ids(inst: Instance) -> list[str]:
    """Every job the controller still lists as pending, running or completing."""
    return run(inst, "squeue", "-h", "-o", "%A", check=False, timeout=10).split()


def cancel_all_jobs(inst: Instance) -> None:
    jobs = job_ids(inst)
    if jobs:
        run(inst, "scancel", *jobs, check=False)
