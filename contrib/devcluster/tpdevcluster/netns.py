"""The nodes' network: one network namespace per node with two paths, each a veth pair into a
bridge: eth0 on the management network (host side 10.77.<id>.1; Slurm, the broker, the nodes'
names) and eth1 on the compute fabric (10.78.<id>.0/24, node to node only; the path the job's
collectives take where the site config names it). Cutting and healing a node (eth0), taking one
path down and up, limiting a node's rate (a token bucket each way, to stand for a real NIC, or one
link per group of ports out of it, to stand for one NIC per GPU), and
the command prefix that runs a program "on" a node (its netns, hostname and /etc/hosts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .errors import DevClusterError
from .hostinfo import tool
from .instance import Instance

IFACES = ("eth0", "eth1")  # every node's two paths: management, compute fabric


def ip(*args: str, check: bool = True) -> str:
    res = subprocess.run([tool("ip"), *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise DevClusterError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
    return res.stdout


def create(inst: Instance) -> None:
    """Bridge, namespaces and veth pairs for every node of ``inst``."""
    # nf_call_* 0: a host firewall (Docker's FORWARD DROP, say) must not filter node-to-node traffic.
    ip("link", "add", inst.bridge, "type", "bridge",
       "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0")
    ip("addr", "add", f"{inst.bridge_addr}/24", "dev", inst.bridge)
    ip("link", "set", inst.bridge, "up")
    ip("link", "add", inst.fabric_bridge, "type", "bridge",
       "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0")
    ip("link", "set", inst.fabric_bridge, "up")  # no host address: the fabric joins nodes only
    for node in inst.node_names:
        ns = inst.netns(node)
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        for iface, bridge, addr in (("eth0", inst.bridge, inst.node_addr(node)),
                                    ("eth1", inst.fabric_bridge, inst.fabric_addr(node))):
            end = inst.host_end(node, iface)
            ip("link", "add", end, "type", "veth", "peer", "name", iface, "netns", ns)
            ip("link", "set", end, "master", bridge, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            ip("-n", ns, "link", "set", iface, "up")
        ip("-n", ns, "route", "add", "default", "via", inst.bridge_addr)


def namespaces(inst: Instance) -> list[str]:
    """This instance's network namespaces that exist now."""
    prefix = f"tpdc{inst.id}-"
    return [line.split()[0] for line in ip("netns", "list", check=False).splitlines()
            if line.startswith(prefix)]


def links(inst: Instance) -> list[str]:
    """This instance's bridges and host-side veths that exist now."""
    names = []
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name in (inst.bridge, inst.fabric_bridge) or name.startswith((f"tpv{inst.id}n", f"tpf{inst.id}n")):
            names.append(name)
    return names


def namespace_pids(ns: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", ns, check=False).split()]


def destroy(inst: Instance) -> None:
    """Delete namespaces, veths and the bridge (processes inside must be gone already)."""
    for ns in namespaces(inst):
        ip("netns", "del", ns, check=False)
    for link in links(inst):
        ip("link", "del", link, check=False)


def set_link(inst: Instance, node: str, up: bool, iface: str = "eth0") -> None:
    """Take the node's path ``iface`` down or up (eth0 down: the node is cut off from Slurm, the
    broker and its peers' management addresses); its processes keep running. The node side sees
    the carrier go, as with a pulled cable."""
    ip("link", "set", inst.host_end(node, iface), "up" if up else "down")
    if up:
        # Address resolutions that failed or are still failing during the cut would make the
        # first connections after the heal fail with EHOSTUNREACH; forget them on the node's side.
        ip("-n", inst.netns(node), "neigh", "flush", "dev", iface, check=False)
        if iface == "eth0":
            ip("neigh", "flush", "dev", inst.bridge, "to", inst.node_addr(node), check=False)


def _tc(*args: str, check: bool = True) -> str:
    res = subprocess.run([tool("tc"), *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise DevClusterError(f"`tc {' '.join(args)}` failed: {res.stderr.strip()}")
    return res.stdout


def set_rate(inst: Instance, node: str, gbit: float | None) -> None:
    """Limit the node's link to ``gbit`` Gbit/s in each direction (a token bucket on the host-side
    veth for traffic into the node, on its eth0 for traffic out); None removes the limit."""
    ends = (("-n", inst.netns(node), "qdisc"), ("qdisc",))
    for where, dev in zip(ends, ("eth0", inst.veth(node)), strict=True):
        if gbit is None:
            _tc(*where, "del", "dev", dev, "root", check=False)  # none set: nothing to remove
            continue
        burst = max(1 << 20, int(gbit * 1e9 / 8 / 100))  # 10 ms of traffic: the rate holds at any HZ
        _tc(*where, "replace", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", str(burst),
            "latency", "50ms")


def set_port_rates(inst: Instance, node: str, gbit: float, groups: list[list[int]]) -> None:
    """Give each group of TCP destination ports a link of its own out of the node, ``gbit`` Gbit/s
    each (one NIC per GPU, as on an NVL72 tray: each rank's stream on its own link): an htb class
    per group on the node's eth0, its other traffic and everything into it unlimited. Replaces any
    rate limit; set_rate(None) removes it."""
    where = ("-n", inst.netns(node))
    set_rate(inst, node, None)
    burst = str(max(1 << 20, int(gbit * 1e9 / 8 / 100)))  # 10 ms of traffic, as set_rate's
    _tc(*where, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
    _tc(*where, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
        "quantum", "60000")
    for cls, ports in enumerate(groups, start=2):
        _tc(*where, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{cls}", "htb", "rate",
            f"{gbit}gbit", "burst", burst, "cburst", burst, "quantum", "60000")
        for port in ports:
            _tc(*where, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dport", str(port), "0xffff", "flowid", f"1:{cls}")


def link_rate(inst: Instance, node: str) -> str | None:
    """The rate limit on the node's link as tc prints it (e.g. "8Gbit"; "1Gbit per port group" for
    set_port_rates' links), or None when unlimited."""
    words = _tc("qdisc", "show", "dev", inst.veth(node), check=False).split()
    if "tbf" in words and "rate" in words:
        return words[words.index("rate") + 1]
    classes = _tc("-n", inst.netns(node), "class", "show", "dev", "eth0", check=False).splitlines()
    rates = {w[w.index("rate") + 1] for line in classes if " 1:1 " not in line and "rate" in (w := line.split())}
    return f"{', '.join(sorted(rates))} per port group" if rates else None


def link_is_up(inst: Instance, node: str, iface: str = "eth0") -> bool:
    """False while the node's path ``iface`` is down (its host-side veth administratively down)."""
    try:
        return bool(int(Path(f"/sys/class/net/{inst.host_end(node, iface)}/flags").read_text(), 16) & 0x1)
    except OSError:
        return False


def on_node(inst: Instance, node: str, argv: list[str]) -> list[str]:
    """argv wrapped to run inside ``node``: its netns, a UTS namespace with hostname = node, and a
    private mount namespace with the node's /etc/hosts and resolv.conf and its own /dev/shm (a
    move that forgot what a process holds there fails here as it would between real nodes). Not
    `ip netns exec`: it remounts /sys, hides /sys/fs/cgroup, and slurmd 22.05 then refuses to start."""
    inst.node_index(node)
    shm = inst.node_shm(node)
    setup = (f"echo {node} > /proc/sys/kernel/hostname"
             f" && mount --bind {inst.etc}/hosts /etc/hosts"
             f" && mount --bind {inst.etc}/resolv.conf /etc/resolv.conf"
             f" && mkdir -p {shm} && chmod 1777 {shm} && mount --bind {shm} /dev/shm"
             ' && exec "$@"')
    return [tool("nsenter"), f"--net=/run/netns/{inst.netns(node)}",
            tool("unshare"), "--uts", "--mount", "--propagation", "private",
            "/bin/sh", "-c", setup, node, *argv]
