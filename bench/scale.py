"""The orchestrator at scale: a real torchpassd (daemon.serve, its real MQTT pump, registry, health
watch, journal and decision code) behind a real private mosquitto, with a SIMULATED Slurm cluster
(bench/_simcluster.py; default 64 racks x 18 trays = 1,152 nodes, 2 spares per rack) standing in for
slurmctld. Every job node runs a simulated launchpad (its own MQTT connection, retained online state,
Last Will, a heartbeat per timeouts.heartbeat_interval with its rank's step, GPU telemetry replayed
from torchpassd/drill_jobs/health/stable.json). Measures torchpassd's CPU in steady state and, for drains of nodes
in different jobs, the decision latency (drain seen -> spare chosen, from the journal)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._simcluster import RefusingRunner, SimulatedSlurm, Topology, write_drains
from torchpass_common.errors import TorchPassError

ROOT = Path(__file__).resolve().parent.parent
RECORDING = ROOT / "torchpassd" / "drill_jobs" / "health" / "stable.json"
START_TIMEOUT = 240.0
DECISION_TIMEOUT = 30.0


# ------------------------------------------------------------------ child: simulated launchpads


async def _launchpad(broker: Any, job: str, node: str, rank: int, interval: float, sample_every: float,
                     t0: float, stop: asyncio.Event, ready: list[int]) -> None:
    """One simulated launchpad: what launchpad/control.py publishes, with a steady step count."""
    from launchpad.telemetry.collector import Collector
    from launchpad.telemetry.encoding import DeltaEncoder
    from launchpad.telemetry.replay import ReplayBackend
    from torchpass_common import mqtt, protocol

    pid = 100000 + rank
    collector = Collector(ReplayBackend.from_file(RECORDING), node=node)
    collector.open()
    encoder, next_sample = DeltaEncoder(), 0.0

    async def announce(client: mqtt.ControlClient) -> None:
        body = {"node": node, "online": True, "pid": pid, "host": node}
        await client.publish(protocol.state_topic(job, node),
                             protocol.encode(protocol.STATE, job=job, gen=1, body=body), retain=True)

    will = protocol.encode(protocol.STATE, job=job, gen=1, body={"node": node, "online": False})
    async with mqtt.ControlClient(broker, f"sim-launchpad-{job}-{node}", will=(protocol.state_topic(job, node), will),
                                  on_connect=announce) as client:
        await client.wait_connected(START_TIMEOUT)
        ready.append(1)
        await asyncio.sleep(random.uniform(0, interval))  # launchpads are not in phase
        seq = 0
        while not stop.is_set():
            seq += 1
            now = time.time()
            body: dict[str, Any] = {"node": node, "seq": seq, "workers": [
                {"rank": rank, "step": int((now - t0) * 2), "state": "running", "pid": pid, "joining": False,
                 "registered": True, "movable": True}]}  # as a launchpad of a script that registered save/load
            if now >= next_sample:  # like launchpad's Sampler: a GPU sample rides on the next heartbeat
                body["gpu"], next_sample = encoder.encode(collector.sample()), now + sample_every
            try:
                await client.publish(protocol.hb_topic(job, node),
                                     protocol.encode(protocol.HEARTBEAT, job=job, gen=1, body=body),
                                     qos=0, timeout=interval)
            except TorchPassError:
                pass  # a skipped heartbeat, as launchpad does
            await asyncio.sleep(interval)


async def _publishers(spec: dict[str, Any], index: int, count: int) -> None:
    from torchpass_common.config import BrokerConfig

    broker = BrokerConfig(**{**spec["broker"], "keepalive": 10})  # torchpassd's account: it may speak for every job
    topo = Topology(**spec["topology"])
    mine = [(str(job), node, rank) for job, nodes in topo.jobs().items() for rank, node in enumerate(nodes)][index::count]
    stop, ready = asyncio.Event(), []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(_launchpad(broker, job, node, rank, spec["interval"], spec["sample_interval"],
                                            spec["t0"], stop, ready)) for job, node, rank in mine]
    while len(ready) < len(mine) and not stop.is_set():
        await asyncio.sleep(0.2)
    print(json.dumps({"ready": len(ready)}), flush=True)
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------ child: torchpassd


def _daemon(spec: dict[str, Any], config_path: str) -> int:
    import uvloop

    from torchpass_common import config, log
    from torchpassd.daemon import serve

    log.setup("info")
    cfg = config.load(config_path)
    slurm = SimulatedSlurm(Topology(**spec["topology"]), Path(spec["drains"]))
    return uvloop.run(serve(cfg, slurm=slurm, runner=RefusingRunner()))


# ------------------------------------------------------------------ the benchmark


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(what: str, check: Any, timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TorchPassError(f"scale benchmark: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return value


class _Children:
    """The benchmark's child processes, each stopped by its PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[str]:
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "bench.scale", *argv], cwd=ROOT, stderr=out, text=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _decision(client: Any, job: str, node: str) -> dict[str, Any] | None:
    for m in client.call("history", job=job, limit=5):
        if m["source"] != node:
            continue
        chosen = next((p for p in m["phases"] if p["phase"] == "spare_chosen"), None)
        if chosen:
            return {"detect_s": chosen["detail"]["detect_s"], "at": chosen["at"], "target": m["target"]}
        if m["status"] != "running":
            raise TorchPassError(f"migration off {node} ended {m['status']} before a spare was chosen: {m['error']}")
    return None


def run(topo: Topology, *, drains: int, cpu_window: float, publishers: int, poll_interval: float,
        workdir: Path) -> dict[str, Any]:
    from tests.support.broker import Mosquitto
    from torchpass_common.config import Timeouts, render
    from torchpassd.ctl_client import DaemonClient

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one socket per simulated launchpad
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    jobs = topo.jobs()
    n_lp = sum(len(v) for v in jobs.values())
    if drains > len(jobs):
        raise TorchPassError(f"{drains} drains need as many jobs; the topology has {len(jobs)}",
                             hint="lower --drains or --job-racks")
    interval = Timeouts().heartbeat_interval
    children = _Children()
    broker = Mosquitto(workdir / "mosquitto")
    broker.conf.write_text(broker.conf.read_text().replace("log_type all", "log_type warning"))
    spec = {"topology": topo.as_dict(), "broker": broker.section(),
            "drains": str(workdir / "drains.json"), "interval": interval, "sample_interval": 5.0, "t0": time.time()}
    (workdir / "spec.json").write_text(json.dumps(spec))
    sock = workdir / "tpd.sock"
    (workdir / "torchpass.toml").write_text(
        render({"broker": broker.section(), "slurm": {"poll_interval": poll_interval},
                "orchestrator": {"state_dir": str(workdir / "state"), "control_socket": str(sock), "metrics_port": 0}}))
    client = DaemonClient(sock, timeout=30)
    result: dict[str, Any] = {"nodes": topo.size, **topo.as_dict(), "spares": len(topo.spares()), "jobs": len(jobs),
                              "heartbeating_nodes": n_lp, "heartbeat_interval_s": interval,
                              "slurm_poll_interval_s": poll_interval, "publisher_processes": publishers,
                              "slurm": "simulated (bench/_simcluster.py stands in for slurmctld)"}
    try:
        broker.start()
        daemon = children.start(["--role", "daemon", "--spec", str(workdir / "spec.json"),
                                 "--config", str(workdir / "torchpass.toml")], workdir / "torchpassd.log",
                                stdout=subprocess.DEVNULL)

        def answers() -> bool:
            if daemon.poll() is not None:
                raise TorchPassError(f"simulated torchpassd exited ({daemon.returncode}); see {workdir}/torchpassd.log")
            try:
                client.call("status")
            except TorchPassError:
                return False
            return True
        _wait("torchpassd to answer", answers, 60, 0.2)
        pubs = [children.start(["--role", "publisher", "--spec", str(workdir / "spec.json"), "--index", str(i),
                                "--of", str(publishers)], workdir / f"publisher-{i}.log", stdout=subprocess.PIPE)
                for i in range(publishers)]
        for p in pubs:
            assert p.stdout is not None
            if not p.stdout.readline():
                raise TorchPassError(f"a launchpad publisher exited; see {workdir}/publisher-*.log")

        def all_online() -> bool:
            lps = [lp for j in client.call("jobs") for lp in j["launchpads"].values()]
            return sum(1 for lp in lps if lp["online"] and lp["workers"]) >= n_lp
        _wait(f"torchpassd to see {n_lp} launchpads", all_online, START_TIMEOUT, 2.0)
        time.sleep(2 * interval)
        cpu0, t0 = _cpu_seconds(daemon.pid), time.monotonic()
        time.sleep(cpu_window)
        cpu1, t1 = _cpu_seconds(daemon.pid), time.monotonic()
        result["torchpassd_cpu_percent"] = round(100 * (cpu1 - cpu0) / (t1 - t0), 1)
        result["cpu_window_s"] = round(t1 - t0, 1)
        result["torchpassd_rss_mib"] = round(int(Path(f"/proc/{daemon.pid}/statm").read_text().split()[1])
                                             * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
        drained: dict[str, str] = {}
        latencies, totals, chosen = [], [], []
        for jid in list(jobs)[:drains]:
            node = jobs[jid][-1]  # never the batch host
            drained[node] = "bench: simulated drain"
            written = time.time()
            write_drains(Path(spec["drains"]), drained)
            dec = _wait(f"a decision for {node}", lambda j=str(jid), n=node: _decision(client, j, n),
                        DECISION_TIMEOUT, 0.05)
            latencies.append(dec["detect_s"] * 1e3)
            totals.append((dec["at"] - written) * 1e3)
            chosen.append(dec["target"])
            time.sleep(0.5)
        result["decision_latency_ms"] = round(statistics.median(latencies), 1)
        result["decision_latency_ms_max"] = round(max(latencies), 1)
        result["decision_latency_ms_all"] = [round(v, 1) for v in latencies]
        result["spares_chosen"] = chosen
        result["drain_to_decision_ms"] = round(statistics.median(totals), 1)  # includes waiting for the Slurm poll
        result["definition"] = ("decision_latency_ms: torchpassd saw the drain in its Slurm poll -> spare chosen "
                                "(journal phase spare_chosen, detail detect_s); drain_to_decision_ms adds the wait "
                                "for the next poll")
    finally:
        children.stop()
        broker.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return result


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench scale")
    p.add_argument("--racks", type=int, default=64)
    p.add_argument("--trays", type=int, default=18)
    p.add_argument("--spares-per-rack", type=int, default=2)
    p.add_argument("--job-racks", type=int, default=8, help="racks per job (default 8: 8 jobs of 128 nodes)")
    p.add_argument("--drains", type=int, default=5, help="drains, each in another job (default 5)")
    p.add_argument("--cpu-window", type=float, default=20.0, help="seconds of steady state for the CPU figure")
    p.add_argument("--publishers", type=int, default=4, help="processes hosting the simulated launchpads")
    p.add_argument("--poll-interval", type=float, default=1.0, help="simulated Slurm poll interval (s)")
    p.add_argument("--workdir", help="keep logs and the journal here (default: a temporary directory)")
    a = p.parse_args(argv)
    topo = Topology(a.racks, a.trays, a.spares_per_rack, a.job_racks)
    kw = {"drains": a.drains, "cpu_window": a.cpu_window, "publishers": a.publishers, "poll_interval": a.poll_interval}
    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
        return run(topo, workdir=Path(a.workdir), **kw)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        return run(topo, workdir=Path(tmp), **kw)


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["daemon", "publisher"], required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--config")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--of", type=int, default=1)
    a = p.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    if a.role == "daemon":
        return _daemon(spec, a.config)
    import uvloop
    uvloop.run(_publishers(spec, a.index, a.of))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
