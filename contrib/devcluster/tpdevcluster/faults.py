"""Fault injection on a running instance: kill-node (a dying tray), start-node, cut and heal
(a network partition), link-down, link-up and link-flap (one of a node's two paths), shape (a
slower link), and reset, which undoes every fault and cancels all jobs so each test
starts from a clean, fully usable cluster without a restart."""

from __future__ import annotations

import shutil
import signal
import time

from . import daemons, netns, procs, slurmctl
from .cluster import NODES_TIMEOUT, READY_STATES, Say, wait_nodes
from .errors import DevClusterError
from .instance import Instance


def require_up(inst: Instance) -> None:
    if not inst.nodes or not procs.daemon_pid(inst, "slurmctld"):
        raise DevClusterError("the dev cluster is not up", instance=inst.id,
                              hint="run `contrib/devcluster/devcluster up` first")


def kill_node(inst: Instance, node: str, say: Say) -> None:
    """SIGKILL every process inside the node (slurmd, slurmstepd, tasks), as a dying tray would."""
    require_up(inst)
    ns = inst.netns(node)
    deadline = time.monotonic() + 10
    killed: set[int] = set()
    while pids := [p for p in netns.namespace_pids(ns) if procs.alive(p)]:
        if time.monotonic() > deadline:
            raise DevClusterError(f"processes {pids} survived SIGKILL", instance=inst.id, node=node)
        procs.signal_pids(pids, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.02)
    shutil.rmtree(inst.node_shm(node), ignore_errors=True)  # a dead tray's memory is gone with it
    say(f"{node}: killed {len(killed)} processes; the controller will notice (NOT_RESPONDING ~13 s)")


def start_node(inst: Instance, node: str, say: Say, timeout: float = NODES_TIMEOUT) -> None:
    """(Re)start the node's slurmd and wait until the controller has its registration."""
    require_up(inst)
    if procs.daemon_pid(inst, f"slurmd.{node}"):
        say(f"{node}: slurmd already running")
        return
    if not netns.link_is_up(inst, node):
        raise DevClusterError("cannot start a node whose network is cut", instance=inst.id, node=node,
                              hint=f"run `devcluster heal {node}` first")
    launched = int(time.time())
    daemons.start_slurmd(inst, node)

    def registered() -> bool:
        rec = slurmctl.node_record(inst, node)
        started = rec.get("SlurmdStartTime", "")
        try:
            started_at = time.mktime(time.strptime(started, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return False
        return started_at >= launched and "NOT_RESPONDING" not in rec.get("State", "")

    procs.wait_ready(inst, f"slurmd.{node}", registered, timeout, log=inst.log_dir / f"slurmd.{node}.log")
    say(f"{node}: slurmd registered ({slurmctl.node_states(inst).get(node, '?')})")


def cut(inst: Instance, node: str, say: Say) -> None:
    """A network partition of the node: both its paths down (its processes keep running)."""
    require_up(inst)
    for iface in netns.IFACES:
        netns.set_link(inst, node, False, iface)
    say(f"{node}: network cut (processes keep running)")


def heal(inst: Instance, node: str, say: Say) -> None:
    require_up(inst)
    for iface in netns.IFACES:
        netns.set_link(inst, node, True, iface)
    say(f"{node}: network healed")


def link(inst: Instance, node: str, iface: str, up: bool, say: Say) -> None:
    """Take one of the node's paths (eth0 management, eth1 compute fabric) down or up."""
    require_up(inst)
    netns.set_link(inst, node, up, iface)
    say(f"{node}: {iface} {'up' if up else 'down'}")


def link_flap(inst: Instance, node: str, iface: str, period: float, duration: float, say: Say) -> None:
    """Flap the node's path ``iface`` for ``duration`` seconds: down for half of each ``period``,
    up for the other half, as a marginal cable or transceiver does; it is up when this returns."""
    require_up(inst)
    if period <= 0 or duration <= 0:
        raise DevClusterError(f"link-flap needs a positive period and duration, got {period} and {duration}",
                              instance=inst.id, node=node)
    end, flips = time.monotonic() + duration, 0
    try:
        while time.monotonic() < end:
            netns.set_link(inst, node, False, iface)
            time.sleep(period / 2)
            netns.set_link(inst, node, True, iface)
            flips += 2
            time.sleep(period / 2)
    finally:
        netns.set_link(inst, node, True, iface)
    say(f"{node}: {iface} flapped {flips} times in {duration:g} s; up now")


def shape(inst: Instance, node: str, gbit: float, say: Say, port_groups: list[list[int]] | None = None) -> None:
    """Limit the node's link to ``gbit`` Gbit/s each way; 0 removes the limit. With ``port_groups``:
    a link of ``gbit`` out of the node for each group of destination ports instead (one NIC per GPU)."""
    require_up(inst)
    if gbit < 0:
        raise DevClusterError(f"link rate must be positive Gbit/s or 0 (unlimited), not {gbit}",
                              instance=inst.id, node=node)
    if port_groups and gbit:
        netns.set_port_rates(inst, node, gbit, port_groups)
        say(f"{node}: {len(port_groups)} links of {gbit:g} Gbit/s out, one per port group")
        return
    netns.set_rate(inst, node, gbit or None)
    say(f"{node}: link limited to {gbit:g} Gbit/s each way" if gbit else f"{node}: link rate unlimited")


def reset(inst: Instance, say: Say, timeout: float = NODES_TIMEOUT) -> None:
    """Back to a clean, fully usable cluster without a restart: heal cut nodes and fabric links, lift rate limits,
    restart killed slurmds, cancel every job, resume drained/down nodes, restore the spare reservation."""
    require_up(inst)
    for node in inst.node_names:
        if not all(netns.link_is_up(inst, node, iface) for iface in netns.IFACES):
            heal(inst, node, say)
        if netns.link_rate(inst, node):
            shape(inst, node, 0, say)
    for node in inst.node_names:
        if not procs.daemon_pid(inst, f"slurmd.{node}"):
            start_node(inst, node, say)
    slurmctl.cancel_all_jobs(inst)
    deadline = time.monotonic() + timeout
    while slurmctl.job_ids(inst):
        if time.monotonic() > deadline:
            raise DevClusterError(f"jobs {slurmctl.job_ids(inst)} did not end after scancel",
                                  instance=inst.id, hint=f"see {inst.log_dir}/slurmctld.log")
        time.sleep(0.1)
    if any(slurmctl.allocated_cpus(inst).values()):
        # A slurmd killed while a step was being launched on it can leave a CPU counted as
        # allocated after its job ended (seen on 22.05); a reconfigure recounts from the live jobs.
        say("stale CPU allocations without jobs: scontrol reconfigure")
        slurmctl.run(inst, "scontrol", "reconfigure")
    for node, state in slurmctl.node_states(inst).items():
        if any(word in state for word in ("drain", "down", "fail")):
            slurmctl.resume(inst, node)
    slurmctl.ensure_reservation(inst)
    wait_nodes(inst, inst.node_names, READY_STATES, timeout)
    say("reset: no jobs, all nodes up, unlimited and idle, spare reservation restored")
