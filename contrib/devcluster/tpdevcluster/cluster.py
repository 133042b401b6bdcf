"""The life cycle of one dev cluster instance: up (idempotent), down (leaves nothing behind) and
status. It orders the work of conffiles, netns, daemons and slurmctl; it does not know how any
single daemon is started, nor how faults are injected (faults.py)."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

from . import broker, conffiles, daemons, hostinfo, netns, procs, slurmctl
from .errors import DevClusterError
from .instance import SPARE_RESERVATION, Instance

Say = Callable[[str], None]
SERVICES = ("munged", "mariadbd", "slurmdbd", "slurmctld", "mosquitto")
MAX_NODES = 50
NODES_TIMEOUT = 30.0
SLURMD_RESTARTS = 2  # times wait_nodes may start a slurmd again that exited at start-up
READY_STATES = {"idle", "reserved"}
STATE_SENTINEL = ".torchpass-devcluster"


def daemon_names(inst: Instance) -> list[str]:
    return [*SERVICES, *(f"slurmd.{n}" for n in inst.node_names)]


def healthy(inst: Instance) -> bool:
    """Every daemon runs, every node's namespace exists with both paths up, the controller answers."""
    if not inst.nodes or not all(procs.daemon_pid(inst, d) for d in daemon_names(inst)):
        return False
    if sorted(netns.namespaces(inst)) != sorted(inst.netns(n) for n in inst.node_names):
        return False
    return all(netns.link_is_up(inst, n, i) for n in inst.node_names for i in netns.IFACES) and slurmctl.ping(inst)


def up(inst: Instance, nodes: int, spares: int, say: Say) -> Instance:
    """Bring the instance up with ``nodes`` nodes, the last ``spares`` reserved as spares.
    A healthy instance of the same shape is left running (only its reservation is restored)."""
    host = hostinfo.detect()
    want = inst.with_shape(nodes, spares)
    if (inst.nodes, inst.spares) == (nodes, spares) and healthy(inst):
        slurmctl.ensure_reservation(want)
        say(f"already up with {nodes} nodes ({spares} spare); nothing to do")
        return want
    if leftovers(inst):
        say("tearing down the previous instance first")
        down(inst, say)
    say(f"Debian {host.debian}, Slurm {host.slurm_release}, plugins in {host.plugin_dir}")
    daemons.check_ports_free(want)
    fresh_state_dir(want)
    try:
        start(want, host, say)
    except BaseException:
        say(f"bring-up failed; stopping what was started (logs stay in {want.log_dir})")
        down(want, say)
        raise
    return want


def fresh_state_dir(inst: Instance) -> None:
    """Empty the state directory, refusing one that a dev cluster did not make."""
    d = inst.state_dir
    ours = (d / STATE_SENTINEL).exists() or conffiles.is_ours(inst.slurm_conf)
    if d.is_dir() and any(d.iterdir()) and not ours:
        raise DevClusterError(f"{d} is not empty and is not a dev cluster state directory; refusing to wipe it",
                              instance=inst.id, hint="point TORCHPASS_DEVCLUSTER_DIR at a new directory")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / STATE_SENTINEL).write_text("state directory of a TorchPass dev cluster; `devcluster up` wipes it\n")


def start(want: Instance, host: hostinfo.HostInfo, say: Say) -> None:
    """Configure and start everything, in dependency order, each step checked before the next."""
    conffiles.write_all(want, host)
    want.write_shape()
    say(f"config written to {want.etc}")
    netns.create(want)
    say(f"network up: bridge {want.bridge} {want.bridge_addr}/24, nodes {', '.join(want.node_names)}")
    daemons.start_munge(want)
    say("munged ready")
    daemons.start_mariadb(want)
    say(f"MariaDB ready on 127.0.0.1:{want.port('mariadb')}")
    daemons.start_slurmdbd(want)
    say(f"slurmdbd ready on 127.0.0.1:{want.port('slurmdbd')}")
    daemons.start_slurmctld(want)
    say(f"slurmctld ready on {want.bridge_addr}:{want.port('slurmctld')}")
    for node in want.node_names:
        daemons.start_slurmd(want, node)
    daemons.start_mosquitto(want)
    say(f"mosquitto ready on {want.bridge_addr}:{want.port('mosquitto')} (TLS, accounts only)")
    wait_nodes(want, want.node_names, {"idle"}, NODES_TIMEOUT, restart=lambda node: daemons.start_slurmd(want, node),
               say=say)
    say(f"all {want.nodes} nodes idle")
    slurmctl.ensure_reservation(want)
    if want.spares:
        say(f"reservation {SPARE_RESERVATION} holds {', '.join(want.spare_names)}")


def wait_nodes(inst: Instance, nodes: list[str], states: set[str], timeout: float, *,
               restart: Callable[[str], None] | None = None, say: Say | None = None) -> None:
    """Poll sinfo until every node in ``nodes`` is in one of ``states``. ``restart``: start a
    node's slurmd again if it exited meanwhile (up to SLURMD_RESTARTS times each; once, right after
    a `down`, one exited at start-up), else its exit is an error at once."""
    deadline = time.monotonic() + timeout
    restarts: dict[str, int] = {}
    while True:
        current = slurmctl.node_states(inst)
        if all(current.get(n) in states for n in nodes):
            return
        dead = [n for n in nodes if not procs.daemon_pid(inst, f"slurmd.{n}")]
        if dead:
            node = dead[0]
            log = inst.log_dir / f"slurmd.{node}.log"
            if restart is None or restarts.get(node, 0) >= SLURMD_RESTARTS:
                raise DevClusterError("slurmd is not running", instance=inst.id, node=",".join(dead),
                                      hint=f"its log {log} ends with:\n{procs.log_tail(log)}")
            restarts[node] = restarts.get(node, 0) + 1
            if say is not None:
                last = (procs.log_tail(log).strip().splitlines() or ["its log is empty"])[-1]
                say(f"{node}: slurmd exited while starting ({last}); starting it again")
            restart(node)
            continue
        if time.monotonic() > deadline:
            raise DevClusterError(f"nodes not {'/'.join(sorted(states))} after {timeout:.0f} s: {current}",
                                  instance=inst.id, hint=f"see the logs in {inst.log_dir}")
        time.sleep(0.1)


def leftovers(inst: Instance) -> bool:
    """Anything of this instance still exists: a daemon, a marked process, a namespace or a link."""
    names = daemon_names(inst)
    return bool(any(procs.daemon_pid(inst, d) for d in names) or procs.marked_pids(inst)
                or netns.namespaces(inst) or netns.links(inst))


def down(inst: Instance, say: Say) -> None:
    """Stop every process of the instance (daemons, then anything marked or inside its nodes),
    then delete its namespaces, veths and bridge. Logs stay in the state directory."""
    pids = {d: procs.daemon_pid(inst, d) for d in daemon_names(inst)}
    running = [p for p in pids.values() if p]
    if running:
        say(f"stopping {len(running)} daemons")
        procs.stop(running, grace=3.0)
    deadline = time.monotonic() + 10
    while True:
        rest = set(procs.marked_pids(inst))
        for ns in netns.namespaces(inst):
            rest.update(p for p in netns.namespace_pids(ns) if procs.alive(p))
        if not rest:
            break
        if time.monotonic() > deadline:
            raise DevClusterError(f"processes {sorted(rest)} survived SIGKILL", instance=inst.id,
                                  hint="are they stuck in the kernel (state D)? check ps")
        procs.signal_pids(rest, signal.SIGKILL)
        time.sleep(0.05)
    netns.destroy(inst)
    shutil.rmtree(inst.shm_dir, ignore_errors=True)
    for name in pids:
        inst.pidfile(name).unlink(missing_ok=True)
        inst.spawn_record(name).unlink(missing_ok=True)
    inst.shape_file.unlink(missing_ok=True)
    say("down: no process, namespace or link of this instance is left")


def status(inst: Instance) -> dict[str, Any]:
    """One JSON-able picture of the instance (the documented keys of `status --json`)."""
    daemons_now = {d: procs.daemon_pid(inst, d) for d in daemon_names(inst)} if inst.nodes else {}
    ctld = bool(daemons_now.get("slurmctld")) and slurmctl.ping(inst)
    states = slurmctl.node_states(inst) if ctld else {}
    spares = set(inst.spare_names)
    nodes = [{
        "name": n, "addr": inst.node_addr(n), "state": states.get(n, "unknown"), "spare": n in spares,
        "link": "up" if netns.link_is_up(inst, n) else "cut", "rate": netns.link_rate(inst, n),
        "fabric_addr": inst.fabric_addr(n), "fabric": "up" if netns.link_is_up(inst, n, "eth1") else "down",
        "netns": inst.netns(n),
        "slurmd_pid": daemons_now.get(f"slurmd.{n}"),
    } for n in inst.node_names]
    reserved = slurmctl.reservation_nodes(inst) if ctld else None
    return {
        "id": inst.id,
        "cluster_name": inst.cluster_name,
        "up": bool(inst.nodes) and ctld and all(daemons_now.values()),
        "state_dir": str(inst.state_dir),
        "slurm_conf": str(inst.slurm_conf),
        "torchpass_config": str(inst.torchpass_config),
        "broker": broker.settings(inst),
        "credentials": broker.credentials(inst),
        "broker_plain_port": inst.port("mosquitto_plain"),  # no TLS: refuses every client
        "slurmctld": {"host": inst.bridge_addr, "port": inst.port("slurmctld")},
        "nodes": nodes,
        "spare_reservation": {"name": SPARE_RESERVATION, "nodes": reserved or []},
        "daemons": daemons_now,
        "jobs_dir": str(inst.jobs_dir),
        "log_dir": str(inst.log_dir),
    }
