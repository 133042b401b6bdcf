"""Starting each daemon of an instance with its readiness check: munged, MariaDB, slurmdbd,
slurmctld, one slurmd per node, and mosquitto. Every daemon runs in the foreground under
procs.spawn (marker + pidfile); the order and the teardown belong to cluster.py."""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from . import broker, netns, procs, slurmctl
from .conffiles import DB_PASSWORD, DB_USER
from .errors import DevClusterError
from .hostinfo import tool
from .instance import Instance

DAEMON_TIMEOUT = 30.0
HOST_SERVICES = ("mariadb", "slurmdbd", "slurmctld", "mosquitto")  # slurmd listens inside the nodes
TEMPLATE_CACHE = Path("/tmp/tpdc-cache")
# Small and not durable: the accounting database lives as long as the dev cluster.
MARIADB_OPTS = ["--innodb-log-file-size=8M", "--innodb-buffer-pool-size=32M",
                "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0"]


def tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def check_ports_free(inst: Instance) -> None:
    """Fail before starting anything if a port of the instance is taken by another program."""
    for service in HOST_SERVICES:
        port = inst.port(service)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError as exc:
                raise DevClusterError(f"port {port} ({service}) is in use by another program: {exc.strerror}",
                                      instance=inst.id, hint="stop that program or choose another "
                                      "TORCHPASS_DEVCLUSTER_ID") from exc


def start_munge(inst: Instance) -> None:
    base = inst.sub("munge")
    for sub, mode in (("key", 0o700), ("run", 0o755), ("log", 0o700), ("lib", 0o700)):
        (base / sub).mkdir(parents=True, exist_ok=True)
        (base / sub).chmod(mode)
    base.chmod(0o755)  # munged insists the socket's directories are searchable by everyone
    key = base / "key" / "munge.key"
    if not key.exists():
        subprocess.run([tool("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True, timeout=20)
    inst.munge_socket.unlink(missing_ok=True)
    procs.spawn(inst, "munged", [
        tool("munged"), "-F", f"--key-file={key}", f"--socket={inst.munge_socket}",
        f"--pid-file={inst.pidfile('munged')}", f"--log-file={base}/log/munged.log",
        f"--seed-file={base}/lib/munged.seed", "--num-threads=10"])
    procs.wait_ready(inst, "munged", inst.munge_socket.exists, DAEMON_TIMEOUT, log=base / "log" / "munged.log")


def _sql(inst: Instance, statement: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("mariadb"), "--no-defaults", "-S", str(inst.sub("db") / "mysql.sock"),
                           "-uroot", "-e", statement], capture_output=True, text=True, timeout=20)


def _mariadb_template() -> Path:
    """An initialised, empty MariaDB data directory, made once per host and MariaDB version and
    copied by every `up`: mariadb-install-db takes ~10 s on a busy machine, a copy 0.1 s."""
    version = subprocess.run([tool("mariadbd"), "--version"], capture_output=True, text=True, timeout=30).stdout
    template = TEMPLATE_CACHE / f"mariadb-{hashlib.sha1(version.encode()).hexdigest()[:12]}"
    if (template / "mysql").is_dir():
        return template
    TEMPLATE_CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=TEMPLATE_CACHE, prefix="install-"))
    res = subprocess.run([tool("mariadb-install-db"), "--no-defaults", f"--datadir={scratch}", "--user=root",
                          "--auth-root-authentication-method=normal", *MARIADB_OPTS],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise DevClusterError("mariadb-install-db failed", hint=(res.stdout + res.stderr)[-1500:])
    try:
        scratch.rename(template)
    except OSError:  # another `up` made it first
        shutil.rmtree(scratch, ignore_errors=True)
    return template


def start_mariadb(inst: Instance) -> None:
    db = inst.sub("db")
    data = db / "data"
    shutil.copytree(_mariadb_template(), data)
    log = inst.log_dir / "mariadbd.err"
    procs.spawn(inst, "mariadbd", [
        tool("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=root",
        f"--port={inst.port('mariadb')}", "--bind-address=127.0.0.1", f"--socket={db}/mysql.sock",
        f"--pid-file={inst.pidfile('mariadbd')}", f"--log-error={log}", "--skip-name-resolve",
        "--innodb-lock-wait-timeout=900", *MARIADB_OPTS])
    procs.wait_ready(inst, "mariadbd", lambda: _sql(inst, "SELECT 1").returncode == 0, DAEMON_TIMEOUT, log=log)
    grants = "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
    for host in ("127.0.0.1", "localhost"):
        grants += (f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{host}' IDENTIFIED BY '{DB_PASSWORD}';"
                   f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'{host}';")
    res = _sql(inst, grants)
    if res.returncode != 0:
        raise DevClusterError(f"cannot create the accounting database: {res.stderr.strip()}", instance=inst.id)


def start_slurmdbd(inst: Instance) -> None:
    procs.spawn(inst, "slurmdbd", [tool("slurmdbd"), "-D"])  # reads slurmdbd.conf next to $SLURM_CONF
    procs.wait_ready(inst, "slurmdbd", lambda: tcp_open("127.0.0.1", inst.port("slurmdbd")),
                     DAEMON_TIMEOUT, log=inst.log_dir / "slurmdbd.log")


def start_slurmctld(inst: Instance) -> None:
    procs.spawn(inst, "slurmctld", [tool("slurmctld"), "-D", "-f", str(inst.slurm_conf)])
    procs.wait_ready(inst, "slurmctld", lambda: slurmctl.ping(inst), DAEMON_TIMEOUT,
                     log=inst.log_dir / "slurmctld.log")


def start_slurmd(inst: Instance, node: str) -> None:
    """Start the node's slurmd inside its namespaces; readiness is the controller's business."""
    argv = [tool("slurmd"), "-D", "-f", str(inst.slurm_conf), "-N", node]
    procs.spawn(inst, f"slurmd.{node}", netns.on_node(inst, node, argv))


def start_mosquitto(inst: Instance) -> None:
    procs.spawn(inst, "mosquitto", [tool("mosquitto"), "-c", str(broker.conf(inst))])
    procs.wait_ready(inst, "mosquitto", lambda: tcp_open(inst.bridge_addr, inst.port("mosquitto")), DAEMON_TIMEOUT)
