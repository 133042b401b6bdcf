"""Naming of one dev cluster instance: its id, state directory, subnets (management and compute
fabric), ports, namespaces and links, and its recorded shape (node and spare counts). Pure data: nothing here starts, stops or
touches anything but the shape file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import DevClusterError

ID_ENV = "TORCHPASS_DEVCLUSTER_ID"
DIR_ENV = "TORCHPASS_DEVCLUSTER_DIR"
MARK_ENV = "TORCHPASS_DEVCLUSTER"  # every process we start carries MARK_ENV=<id>
SPARE_RESERVATION = "torchpass_spares"
REPO = Path(__file__).resolve().parents[3]

# Port offsets from 20000 + 100 * id (the team's interface contract).
PORT_OFFSETS = {"mariadb": 6, "slurmctld": 17, "slurmd": 18, "slurmdbd": 19, "slurmrestd": 20,
                "mosquitto_plain": 82, "mosquitto": 83, "credentials": 84}


@dataclass(frozen=True)
class Instance:
    """Everything named after the instance id; ``nodes`` and ``spares`` come from the shape file."""

    id: int
    state_dir: Path
    nodes: int = 0
    spares: int = 0

    @classmethod
    def from_env(cls) -> Instance:
        """The instance selected by $TORCHPASS_DEVCLUSTER_ID (default 0) and its recorded shape."""
        raw = os.environ.get(ID_ENV, "0")
        if not raw.isdigit() or not 0 <= int(raw) <= 9:
            raise DevClusterError(f"{ID_ENV} must be a digit 0-9, got {raw!r}",
                                  hint=f"export {ID_ENV}=N with N in 0..9")
        ident = int(raw)
        state_dir = Path(os.environ.get(DIR_ENV) or f"/tmp/tpdc{ident}")
        inst = cls(ident, state_dir)
        shape = inst.read_shape()
        return inst.with_shape(*shape) if shape else inst

    def with_shape(self, nodes: int, spares: int) -> Instance:
        return Instance(self.id, self.state_dir, nodes, spares)

    # ---- shape file ------------------------------------------------------------------------
    @property
    def shape_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def read_shape(self) -> tuple[int, int] | None:
        try:
            data = json.loads(self.shape_file.read_text())
            return int(data["nodes"]), int(data["spares"])
        except (OSError, ValueError, KeyError):
            return None

    def write_shape(self) -> None:
        self.shape_file.write_text(json.dumps({"nodes": self.nodes, "spares": self.spares}) + "\n")

    # ---- directories -----------------------------------------------------------------------
    def sub(self, name: str) -> Path:
        return self.state_dir / name

    @property
    def shm_dir(self) -> Path:
        """Where the nodes' own /dev/shm directories live on the host (a tmpfs, as /dev/shm is)."""
        return Path(f"/dev/shm/tpdc{self.id}")

    def node_shm(self, node: str) -> Path:
        """``node``'s /dev/shm, as the host sees it: each node has its own, as real nodes do."""
        return self.shm_dir / node

    @property
    def etc(self) -> Path:
        return self.sub("etc")

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def torchpass_config(self) -> Path:
        """The site's torchpass.toml (the SPANK plugin's config= argument)."""
        return self.etc / "torchpass.toml"

    @property
    def log_dir(self) -> Path:
        return self.sub("log")

    @property
    def run_dir(self) -> Path:
        return self.sub("run")

    @property
    def jobs_dir(self) -> Path:
        return self.sub("jobs")

    @property
    def munge_socket(self) -> Path:
        return self.sub("munge") / "run" / "munge.socket.2"

    def pidfile(self, daemon: str) -> Path:
        """Where the daemon itself keeps its pid (its configuration names this file)."""
        return self.run_dir / f"{daemon}.pid"

    def spawn_record(self, daemon: str) -> Path:
        """Where this tool records the pid it started the daemon as. Not the daemon's own pidfile:
        a daemon truncates that before writing it (a reader can find it empty), and a second copy
        refused by its lock rewrites it, so the running daemon's pid would be lost."""
        return self.run_dir / f"{daemon}.started"

    @property
    def cluster_name(self) -> str:
        """slurm.conf's ClusterName: how a tool asking slurmctld tells this dev cluster."""
        return f"tpdc{self.id}"

    # ---- network ---------------------------------------------------------------------------
    @property
    def subnet(self) -> str:
        return f"10.77.{self.id}"

    @property
    def bridge(self) -> str:
        return f"tpbr{self.id}"

    @property
    def bridge_addr(self) -> str:
        return f"{self.subnet}.1"

    def port(self, service: str) -> int:
        return 20000 + 100 * self.id + PORT_OFFSETS[service]

    # ---- nodes -----------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def spare_names(self) -> list[str]:
        return self.node_names[self.nodes - self.spares:] if self.spares else []

    def node_index(self, node: str) -> int:
        if node not in self.node_names:
            raise DevClusterError(f"no node {node!r} in this dev cluster", instance=self.id,
                                  hint=f"nodes are {', '.join(self.node_names) or 'none (is it up?)'}")
        return int(node[1:])

    def node_addr(self, node: str) -> str:
        return f"{self.subnet}.{10 + self.node_index(node)}"

    def netns(self, node: str) -> str:
        return f"tpdc{self.id}-{node}"

    def veth(self, node: str) -> str:
        """Host side of the node's veth pair (the node side is eth0 inside its netns)."""
        return f"tpv{self.id}{node}"

    # ---- the compute fabric: a second network, eth1 in every node --------------------------
    @property
    def fabric_subnet(self) -> str:
        return f"10.78.{self.id}"

    @property
    def fabric_bridge(self) -> str:
        return f"tpfb{self.id}"

    def fabric_addr(self, node: str) -> str:
        return f"{self.fabric_subnet}.{10 + self.node_index(node)}"

    def fabric_veth(self, node: str) -> str:
        """Host side of the node's fabric veth pair (the node side is eth1 inside its netns)."""
        return f"tpf{self.id}{node}"

    def host_end(self, node: str, iface: str) -> str:
        """The host-side veth of ``node``'s interface ``iface`` (eth0: management, Slurm and the
        broker; eth1: the compute fabric)."""
        ends = {"eth0": self.veth, "eth1": self.fabric_veth}
        if iface not in ends:
            raise DevClusterError(f"a dev cluster node has interfaces eth0 and eth1, not {iface!r}",
                                  instance=self.id, node=node)
        return ends[iface](node)

    @property
    def marker(self) -> str:
        return f"{MARK_ENV}={self.id}"
