"""The dev cluster behaves like the multi-node Slurm cluster the rest of TorchPass is tested on:
jobs spread over distinct hosts, drains are visible, spares are reserved, nodes can be killed,
restarted, cut and healed, their links slowed to a given rate, `up` is idempotent, and `down` leaves nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.devcluster import TOOL, DevCluster, instance_id_from_env
from tests.support.ports import free_port

sys.path.insert(0, str(TOOL.parent))  # the tool's own package, tpdevcluster (standard library only)
from tpdevcluster import conffiles, hostinfo, instance

slurm = pytest.mark.slurm  # every test here but the config-rendering one runs on the real cluster
CONNECT = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close();"
           " print('connected')")


def can_connect(cluster: DevCluster, node: str, host: str, port: int) -> bool:
    return cluster.exec(node, [sys.executable, "-c", CONNECT, host, str(port)], check=False).returncode == 0


def marked_processes(instance_id: int) -> list[int]:
    """Live processes carrying the instance's marker (zombies waiting for init do not count)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if f"TORCHPASS_DEVCLUSTER={instance_id}".encode() in environ and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(pid))
    return found


@slurm
def test_status_json_has_the_documented_keys(devcluster: DevCluster) -> None:
    devcluster.reset()
    info = devcluster.info
    assert info["up"] is True and info["id"] == devcluster.id
    assert Path(info["slurm_conf"]).is_file() and Path(info["state_dir"]).is_dir()
    broker = info["broker"]
    assert (broker["host"], broker["port"]) == (f"10.77.{devcluster.id}.1", 20083 + 100 * devcluster.id)
    assert Path(broker["tls_ca"]).is_file() and broker["username"] == "torchpassd"
    assert Path(broker["password_file"]).stat().st_mode & 0o077 == 0  # torchpassd's password: root's only
    assert info["credentials"]["credentials_endpoint"] == f"10.77.{devcluster.id}.1:{20084 + 100 * devcluster.id}"
    assert info["broker_plain_port"] == 20082 + 100 * devcluster.id
    assert [n["name"] for n in info["nodes"]] == ["n1", "n2", "n3", "n4", "n5"]
    assert [n["spare"] for n in info["nodes"]] == [False] * 4 + [True]
    assert all(n["addr"] == f"10.77.{devcluster.id}.{10 + i}" for i, n in enumerate(info["nodes"], 1))
    assert all(n["fabric_addr"] == f"10.78.{devcluster.id}.{10 + i}" and n["fabric"] == "up"
               for i, n in enumerate(info["nodes"], 1))
    assert [n["state"] for n in info["nodes"][:4]] == ["idle"] * 4
    assert info["nodes"][4]["state"] in ("idle", "reserved")
    assert info["spare_reservation"] == {"name": "torchpass_spares", "nodes": ["n5"]}
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "mosquitto", "slurmd.n1", "slurmd.n5"):
        assert Path(f"/proc/{info['daemons'][daemon]}").exists(), daemon


@slurm
@pytest.mark.security
def test_the_broker_refuses_anonymous_clients_and_plain_mqtt(devcluster: DevCluster) -> None:
    """What an operator tries first: publishing a command with no account. The broker's plain port
    answers "not authorised" to everyone (a refusal, not a connection error), torchpassd's own
    account included: no account works without TLS. On the TLS port, with the cluster's CA, no
    account is refused the same way, a plain client there gets nowhere; from inside a node the same."""
    b = devcluster.info["broker"]
    topic = ["-t", "torchpass/v1/jobs/1/nodes/n1/cmd", "-m", "x"]
    plain_port = ["mosquitto_pub", "-h", b["host"], "-p", str(devcluster.info["broker_plain_port"]), *topic]
    password = Path(b["password_file"]).read_text().strip()
    for who in ([], ["-u", b["username"], "-P", password]):
        refused = subprocess.run([*plain_port, *who], capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "not authorised" in (refused.stdout + refused.stderr), refused
    pub = ["mosquitto_pub", "-h", b["host"], "-p", str(b["port"]), *topic]
    refused = subprocess.run([*pub, "--cafile", b["tls_ca"]], capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "not authori" in (refused.stdout + refused.stderr).lower(), refused
    plain = subprocess.run(pub, capture_output=True, text=True, timeout=30)
    assert plain.returncode != 0 and "not authori" not in (plain.stdout + plain.stderr).lower(), plain
    inside = devcluster.exec("n3", [*plain_port], check=False)
    assert inside.returncode != 0 and "not authorised" in (inside.stdout + inside.stderr), inside
    accepted = subprocess.run(["mosquitto_pub", "-h", b["host"], "-p", str(b["port"]), "-t", "torchpass/v1/probe",
                               "-m", "x", "--cafile", b["tls_ca"], "-u", b["username"], "-P", password],
                              capture_output=True, text=True, timeout=30)
    assert accepted.returncode == 0, accepted  # the control: the account over TLS gets in


@slurm
def test_sbatch_on_three_nodes_runs_one_task_per_distinct_host(devcluster: DevCluster) -> None:
    devcluster.reset()
    job = devcluster.sbatch("#!/bin/bash\nsrun bash -c 'echo task $(hostname) $(hostname -I)'\n", "-N", "3")
    devcluster.wait_job_state(job, "COMPLETED", timeout=60)
    tasks = sorted(line.split()[1:] for line in devcluster.job_output(job).splitlines()
                   if line.startswith("task "))
    assert len(tasks) == 3
    assert len({host for host, *_ in tasks}) == 3
    for host, *addrs in tasks:
        assert host in {"n1", "n2", "n3", "n4"}  # never the spare: it is reserved
        # its management address (eth0), then its compute-fabric one (eth1)
        assert addrs == [f"10.77.{devcluster.id}.{10 + int(host[1:])}", f"10.78.{devcluster.id}.{10 + int(host[1:])}"]


@slurm
def test_spare_takes_only_jobs_that_ask_for_the_reservation(devcluster: DevCluster) -> None:
    devcluster.reset()
    normal = devcluster.sbatch("#!/bin/bash\nhostname\n", "-N", "4")
    spare = devcluster.sbatch("#!/bin/bash\nhostname\n", "-N", "1", "--reservation=torchpass_spares")
    devcluster.wait_job_state(normal, "COMPLETED", timeout=60)
    devcluster.wait_job_state(spare, "COMPLETED", timeout=60)
    assert devcluster.job_record(normal)["NodeList"] == "n[1-4]"
    assert devcluster.job_output(spare).split() == ["n5"]


@slurm
def test_a_drained_node_is_seen_draining_while_its_job_runs(devcluster: DevCluster) -> None:
    devcluster.reset()
    job = devcluster.sbatch("#!/bin/bash\nsrun sleep 120\n", "-N", "1", "-w", "n2")
    devcluster.wait_job_state(job, "RUNNING")
    devcluster.drain("n2", "torchpass test drain")
    assert devcluster.node_state("n2") == "draining"
    assert devcluster.job_record(job)["JobState"] == "RUNNING"
    devcluster.run("scancel", job)
    devcluster.wait_node_state("n2", "drained")
    devcluster.resume("n2")
    devcluster.wait_node_state("n2", "idle")


@slurm
def test_exec_runs_inside_the_named_node(devcluster: DevCluster) -> None:
    devcluster.reset()
    out = devcluster.exec("n3", ["sh", "-c", "hostname; hostname -I; getent hosts n1 ctl"]).stdout.split()
    assert out[:3] == ["n3", f"10.77.{devcluster.id}.13", f"10.78.{devcluster.id}.13"]  # eth0, eth1
    assert out[3:5] == [f"10.77.{devcluster.id}.11", "n1"]  # names resolve to the management network
    assert out[5:7] == [f"10.77.{devcluster.id}.1", "ctl"]
    assert devcluster.exec("n3", ["false"], check=False).returncode == 1
    broker = devcluster.info["broker"]
    assert can_connect(devcluster, "n3", broker["host"], broker["port"])


@slurm
def test_kill_node_kills_everything_inside_and_start_node_brings_it_back(devcluster: DevCluster) -> None:
    devcluster.reset()
    # A plain Slurm job as a user writes it (no TorchPass: this tests the dev cluster's kill) on the
    # node killed; its slurmd is back before Slurm's timeout, so the job is cancelled afterwards.
    job = devcluster.sbatch("#!/bin/bash\nsrun sleep 300\n", "-N", "1", "-w", "n3")
    devcluster.wait_job_state(job, "RUNNING")
    netns = f"tpdc{devcluster.id}-n3"
    assert subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    devcluster.kill_node("n3")
    assert subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split() == []
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n3")["slurmd_pid"] is None
    devcluster.start_node("n3")
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n3")["slurmd_pid"]
    devcluster.run("scancel", job)
    devcluster.wait_job_state(job, "CANCELLED")
    assert devcluster.run("srun", "-N1", "-w", "n3", "hostname", timeout=30).stdout.split() == ["n3"]


@slurm
def test_cut_isolates_a_node_whose_processes_keep_running_and_heal_restores_it(devcluster: DevCluster) -> None:
    devcluster.reset()
    broker = devcluster.info["broker"]
    slurmd = next(n for n in devcluster.info["nodes"] if n["name"] == "n4")["slurmd_pid"]
    devcluster.cut("n4")
    try:
        node = next(n for n in devcluster.info["nodes"] if n["name"] == "n4")
        assert node["link"] == "cut" and node["slurmd_pid"] == slurmd
        assert not can_connect(devcluster, "n4", broker["host"], broker["port"])
    finally:
        devcluster.heal("n4")
    assert can_connect(devcluster, "n4", broker["host"], broker["port"])
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n4")["link"] == "up"


def test_a_node_has_two_paths_and_each_goes_down_and_up_alone(devcluster: DevCluster) -> None:
    """eth0 (management: Slurm, the broker, node names) and eth1 (the compute fabric): taking the
    fabric down leaves the node reachable over management and the other way round; a flap ends up."""
    devcluster.reset()
    n2 = next(n for n in devcluster.info["nodes"] if n["name"] == "n2")
    slurmd = 20018 + 100 * devcluster.id  # every node's slurmd listens on all its addresses
    fabric, management = n2["fabric_addr"], n2["addr"]
    assert fabric.startswith("10.78.") and can_connect(devcluster, "n1", fabric, slurmd)
    devcluster.link_down("n2", "eth1")
    try:
        assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["fabric"] == "down"
        assert not can_connect(devcluster, "n1", fabric, slurmd)
        assert can_connect(devcluster, "n1", management, slurmd)
    finally:
        devcluster.link_up("n2", "eth1")
    assert can_connect(devcluster, "n1", fabric, slurmd)
    devcluster.link_down("n2", "eth0")
    try:
        assert can_connect(devcluster, "n1", fabric, slurmd) and not can_connect(devcluster, "n1", management, slurmd)
    finally:
        devcluster.link_up("n2", "eth0")
    flap = devcluster.link_flap("n2", "eth1", period=0.4, duration=1.0)
    out, _ = flap.communicate(timeout=30)
    assert flap.returncode == 0 and "flapped" in out, out
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["fabric"] == "up"


NODE_SIDE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
n, t0 = int(sys.argv[3]), time.monotonic()
if sys.argv[4] == "out":
    conn.sendall(bytes(n))
    assert conn.recv(1) == b"k"
else:
    view = memoryview(bytearray(n))
    while view:
        view = view[conn.recv_into(view):]
print(time.monotonic() - t0)
"""


def transfer_seconds(cluster: DevCluster, node: str, nbytes: int, direction: str, port: int = 0) -> float:
    """Seconds to move ``nbytes`` out of ``node`` (to this host's ``port``) or into it, timed on the node."""
    server = socket.create_server((cluster.info["broker"]["host"], port))
    server.settimeout(60)

    def serve() -> None:
        conn = server.accept()[0]
        with conn:
            if direction == "out":
                view = memoryview(bytearray(nbytes))
                while view:
                    view = view[conn.recv_into(view):]
                conn.sendall(b"k")
            else:
                conn.sendall(bytes(nbytes))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out = cluster.exec(node, [sys.executable, "-c", NODE_SIDE, server.getsockname()[0],
                                  str(server.getsockname()[1]), str(nbytes), direction]).stdout
    finally:
        thread.join(60)
        server.close()
    return float(out.split()[-1])


@slurm
def test_shape_limits_a_node_link_each_way_and_reset_lifts_it(devcluster: DevCluster) -> None:
    devcluster.reset()
    devcluster.shape("n2", 0.1)  # 12.5 MB/s: 4 MB take 0.32 s, less a 1 MiB burst
    try:
        assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["rate"] == "100Mbit"
        for direction in ("out", "in"):
            assert transfer_seconds(devcluster, "n2", 4_000_000, direction) >= 0.2, direction
        assert transfer_seconds(devcluster, "n3", 4_000_000, "in") < 0.2  # other nodes keep their speed
    finally:
        devcluster.reset()
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["rate"] is None


@slurm
def test_shape_gives_each_port_group_a_link_of_its_own_out_of_the_node(devcluster: DevCluster) -> None:
    devcluster.reset()
    slow, other = free_port(), free_port()
    devcluster.shape("n2", 0.1, [[slow]])  # one NIC for the flows to port ``slow``, the rest unlimited
    try:
        assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["rate"] == "100Mbit per port group"
        assert transfer_seconds(devcluster, "n2", 4_000_000, "out", port=slow) >= 0.2
        assert transfer_seconds(devcluster, "n2", 4_000_000, "out", port=other) < 0.2
        assert transfer_seconds(devcluster, "n2", 4_000_000, "in") < 0.2  # into the node: unlimited
    finally:
        devcluster.reset()
    assert next(n for n in devcluster.info["nodes"] if n["name"] == "n2")["rate"] is None


@slurm
def test_up_again_is_a_no_op_that_keeps_every_daemon(devcluster: DevCluster) -> None:
    devcluster.reset()
    before = devcluster.info["daemons"]
    devcluster.up()
    after = devcluster.info
    assert after["up"] and after["daemons"] == before


@slurm
def test_a_slurmd_caught_rewriting_its_own_pidfile_is_still_seen_running(devcluster: DevCluster) -> None:
    """slurmd truncates its pidfile before writing its pid; the tool read that file, took the
    empty moment for a dead slurmd and started a second one, which the pidfile lock refused and
    which left its own pid in the file: every later `reset` then failed ("pidfile locked by ...")."""
    devcluster.reset()
    before = devcluster.info["daemons"]
    (Path(devcluster.info["state_dir"]) / "run" / "slurmd.n2.pid").write_text("")  # caught mid-rewrite
    devcluster.reset()
    assert devcluster.info["daemons"] == before  # the same slurmd, no second one started


@slurm
def test_a_second_instance_comes_up_beside_the_first_and_down_leaves_nothing(devcluster: DevCluster) -> None:
    second = DevCluster((devcluster.id + 5) % 10, nodes=3, spares=1)
    assert instance_id_from_env() != second.id
    second.up()
    try:
        info = second.info
        assert info["up"] and [n["name"] for n in info["nodes"]] == ["n1", "n2", "n3"]
        assert info["broker"]["host"] == f"10.77.{second.id}.1"
        hosts = second.run("srun", "-N2", "hostname").stdout.split()
        assert sorted(hosts) == ["n1", "n2"]
    finally:
        second.down()
    assert marked_processes(second.id) == []
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(f"tpdc{second.id}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"tpbr{second.id}" not in links and f"tpv{second.id}n" not in links
    assert devcluster.info["up"]  # the first instance did not notice


@slurm
@pytest.mark.matrix
def test_twenty_up_down_cycles_in_a_row_each_come_up_whole_and_leave_nothing(devcluster: DevCluster) -> None:
    """`up --nodes 5 --spares 1` right after `down`, twenty times (once, an up right after a down
    failed: a slurmd exited at start-up; up now starts such a slurmd again)."""
    second = DevCluster((devcluster.id + 5) % 10, nodes=5, spares=1)
    cycles = int(os.environ.get("TORCHPASS_DEVCLUSTER_CYCLES", "20"))
    try:
        for cycle in range(cycles):
            second.up()
            info = second.info
            assert info["up"] and len(info["nodes"]) == 5 and all(n["slurmd_pid"] for n in info["nodes"]), (cycle, info)
            assert sorted(second.run("srun", "-N4", "hostname").stdout.split()) == ["n1", "n2", "n3", "n4"]  # n5: spare
            second.down()
            assert marked_processes(second.id) == [], cycle
    finally:
        second.down()
    assert devcluster.info["up"]


@slurm
def test_up_refuses_a_port_another_program_holds_and_starts_nothing(devcluster: DevCluster) -> None:
    second = DevCluster((devcluster.id + 5) % 10, nodes=2, spares=0)
    port = 20000 + 100 * second.id + 17  # the second instance's slurmctld port
    with socket.create_server(("0.0.0.0", port)):
        res = second.tool("up", "--nodes", "2", check=False)
    assert res.returncode == 1
    assert f"port {port} (slurmctld) is in use" in res.stderr
    assert marked_processes(second.id) == []
    assert f"tpbr{second.id}" not in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                                     text=True).stdout


@pytest.mark.parametrize("version", [(22, 5), (24, 11)])
def test_slurm_config_follows_the_detected_release(tmp_path: Path, version: tuple[int, int]) -> None:
    """Debian 13's Slurm 24.11 needs cgroup.conf (CgroupPlugin=disabled) and has no switch/none
    plugin; 22.05 has both ways. Rendered without root or a cluster, so 24.11 is checked here too."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "auth_jwt.so").touch()
    if version < (23, 0):
        (plugins / "switch_none.so").touch()
    host = hostinfo.HostInfo(debian="x", slurm_version=version, plugin_dir=str(plugins), hostname="box",
                             slurm_user="slurm")
    inst = instance.Instance(4, tmp_path / "tpdc4", nodes=3, spares=1)
    conf = conffiles.slurm_conf(inst, host)
    assert host.needs_cgroup_conf == (version >= (24, 5))
    assert ("SwitchType=switch/none" in conf) == (version < (23, 0))
    assert f"PluginDir={plugins}" in conf and "AuthAltTypes=auth/jwt" in conf
    assert "SlurmctldHost=box(10.77.4.1)" in conf and "SlurmctldPort=20417" in conf
    assert "NodeName=n3 NodeHostname=n3 NodeAddr=10.77.4.13" in conf
    assert "SchedulerParameters=permit_job_expansion" in conf and "ReturnToService=1" in conf
