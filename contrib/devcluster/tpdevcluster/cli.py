"""The `devcluster` command line: argument parsing, progress lines, the human status table and
`status --json`. Exit codes: 0 success, 1 failure (message on stderr), 2 usage error."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from . import cluster, faults, hostinfo, netns, procs
from .errors import DevClusterError
from .instance import DIR_ENV, ID_ENV, Instance

MUTATING = {"up", "down", "reset", "kill-node", "start-node", "cut", "heal", "shape", "link-down", "link-up"}
USAGE_EPILOG = f"""instance: ${ID_ENV} (0-9, default 0); state in /tmp/tpdc<ID> (override ${DIR_ENV}).
clients:  eval "$(contrib/devcluster/devcluster env)"   # exports SLURM_CONF"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="devcluster", epilog=USAGE_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="A real multi-node Slurm cluster (one network namespace per "
                                            "node) plus a private MQTT broker, on this machine.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="bring the cluster up (idempotent)")
    up.add_argument("--nodes", type=int, default=5, help="number of nodes (default 5)")
    up.add_argument("--spares", type=int, default=1,
                    help="how many of the last nodes the torchpass_spares reservation holds (default 1)")
    sub.add_parser("down", help="stop everything this instance started and delete its network")
    st = sub.add_parser("status", help="nodes, spare reservation, broker and daemons")
    st.add_argument("--json", action="store_true", help="one JSON object on stdout")
    sub.add_parser("env", help="print shell exports for Slurm clients (eval it)")
    sub.add_parser("reset", help="cancel all jobs, heal/restart/resume nodes, restore the spares")
    ex = sub.add_parser("exec", help="run a command inside a node: exec NODE -- CMD...")
    ex.add_argument("node")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD...")
    for name, text in (("kill-node", "SIGKILL slurmd and every process inside the node"),
                       ("start-node", "start the node's slurmd again and wait for its registration"),
                       ("cut", "cut the node's network (its processes keep running)"),
                       ("heal", "restore the node's network")):
        sub.add_parser(name, help=text).add_argument("node")
    for name, text in (("link-down", "take one of the node's paths down: link-down NODE IFACE (eth0 management, "
                                      "eth1 compute fabric)"),
                       ("link-up", "bring the node's path up again: link-up NODE IFACE")):
        lk = sub.add_parser(name, help=text)
        lk.add_argument("node")
        lk.add_argument("iface", choices=netns.IFACES)
    flap = sub.add_parser("link-flap", help="flap one of the node's paths: link-flap NODE IFACE --period S --for S "
                                            "(down half of each period; returns when done, the link up)")
    flap.add_argument("node")
    flap.add_argument("iface", choices=netns.IFACES)
    flap.add_argument("--period", type=float, default=2.0, help="seconds from one drop to the next (default 2)")
    flap.add_argument("--for", dest="duration", type=float, default=30.0, help="seconds to flap (default 30)")
    shape = sub.add_parser("shape", help="limit the node's link rate, as a real NIC would: shape NODE GBIT (0: unlimited)")
    shape.add_argument("node")
    shape.add_argument("gbit", type=float, help="Gbit/s each way; 0 removes the limit")
    shape.add_argument("--ports", action="append", type=_ports, metavar="PORT,PORT,...",
                       help="instead: a link of GBIT out of the node for these destination ports (repeat: one "
                            "link per group, as one NIC per GPU); the node's other traffic unlimited")
    return p


def _ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of ports: {text!r}") from None
    if not ports or not all(0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be 1..65535, comma-separated: {text!r}")
    return ports


def _sayer(inst_id: int) -> cluster.Say:
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[devcluster {inst_id} +{time.monotonic() - t0:5.2f}s] {msg}", flush=True)
    return say


def _print_status(info: dict[str, Any]) -> None:
    print(f"dev cluster {info['id']}: {'UP' if info['up'] else 'DOWN'}   state {info['state_dir']}")
    print(f"SLURM_CONF={info['slurm_conf']}")
    broker = info["broker"]
    print(f"broker     {broker['host']}:{broker['port']} (TLS, CA {broker['tls_ca']}; accounts only); "
          f"port {info['broker_plain_port']} without TLS refuses everyone")
    res = info["spare_reservation"]
    print(f"spares     reservation {res['name']}: {', '.join(res['nodes']) or '(none)'}")
    if info["nodes"]:
        print(f"{'NODE':<6}{'ADDRESS':<14}{'STATE':<14}{'SPARE':<7}{'LINK':<6}{'RATE':<10}{'FABRIC':<21}SLURMD")
        for n in info["nodes"]:
            print(f"{n['name']:<6}{n['addr']:<14}{n['state']:<14}{'yes' if n['spare'] else '':<7}"
                  f"{n['link']:<6}{n['rate'] or '-':<10}{n['fabric_addr'] + ' ' + n['fabric']:<21}"
                  f"{n['slurmd_pid'] or '-'}")
    daemons = ", ".join(f"{k}={v or 'DEAD'}" for k, v in info["daemons"].items() if not k.startswith("slurmd."))
    print(f"daemons    {daemons or '(none)'}")


def _exec(inst: Instance, node: str, argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise DevClusterError("exec needs a command: exec NODE -- CMD...")
    faults.require_up(inst)
    wrapped = netns.on_node(inst, node, argv)
    os.execve(wrapped[0], wrapped, procs.marked_env(inst))
    return 127  # not reached


@contextlib.contextmanager
def _exclusive(inst: Instance, say: cluster.Say) -> Iterator[Instance]:
    """Serialise commands that change the instance (two `up`s at once would fight); yields the
    instance as recorded once the lock is held."""
    lock = inst.state_dir.with_name(inst.state_dir.name + ".lock")
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another devcluster command on this instance ({lock})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield Instance.from_env()


def run(args: argparse.Namespace) -> int:
    inst = Instance.from_env()
    say = _sayer(inst.id)
    if args.cmd in MUTATING or args.cmd in ("exec", "link-flap"):
        hostinfo.require_root()
    if args.cmd in MUTATING:
        with _exclusive(inst, say) as locked:
            return _mutate(args, locked, say)
    if args.cmd == "status":
        info = cluster.status(inst)
        if args.json:
            print(json.dumps(info))
        else:
            _print_status(info)
        return 0 if info["up"] else 1
    elif args.cmd == "env":
        print(f"export SLURM_CONF={inst.slurm_conf}\nexport {ID_ENV}={inst.id}")
    elif args.cmd == "exec":
        return _exec(inst, args.node, args.argv)
    elif args.cmd == "link-flap":  # not under the instance lock: it runs for a while beside other commands
        inst.node_index(args.node)
        faults.link_flap(inst, args.node, args.iface, args.period, args.duration, say)
    return 0


def _mutate(args: argparse.Namespace, inst: Instance, say: cluster.Say) -> int:
    if args.cmd == "up":
        t0 = time.monotonic()
        cluster.up(inst, args.nodes, args.spares, say)
        say(f"up in {time.monotonic() - t0:.1f} s. Use it with: eval \"$({sys.argv[0]} env)\"; "
            f"stop it with: {sys.argv[0]} down")
    elif args.cmd == "down":
        cluster.down(inst, say)
    elif args.cmd == "reset":
        faults.reset(inst, say)
    elif args.cmd == "shape":
        inst.node_index(args.node)
        faults.shape(inst, args.node, args.gbit, say, args.ports)
    elif args.cmd in ("link-down", "link-up"):
        inst.node_index(args.node)
        faults.link(inst, args.node, args.iface, args.cmd == "link-up", say)
    else:
        action = {"kill-node": faults.kill_node, "start-node": faults.start_node,
                  "cut": faults.cut, "heal": faults.heal}[args.cmd]
        inst.node_index(args.node)
        action(inst, args.node, say)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "up" and not 1 <= args.nodes <= cluster.MAX_NODES:
        parser.error(f"--nodes must be between 1 and {cluster.MAX_NODES}, got {args.nodes}")
    if args.cmd == "up" and not 0 <= args.spares < args.nodes:
        parser.error(f"--spares must be between 0 and {args.nodes - 1} (nodes - 1), got {args.spares}")
    try:
        return run(args)
    except (DevClusterError, OSError) as exc:
        print(f"devcluster: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("devcluster: interrupted; run `devcluster down` to clean up", file=sys.stderr)
        return 130
