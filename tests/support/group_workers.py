"""Runs a process-group workload on N real worker processes on gloo (a TCPStore hosted by the
test, as launchpad and torchrun host one): either on plain torch, or with the TorchPass default
group installed, so that the workload can re-form it between its phases as the worker agent does
on REFORM. Each rank writes its results to $MESH_RESULT_DIR/rank<N>.json (a file, not stdout:
ranks' long lines interleave on a shared pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

# The workloads' reform(gen): what the agent does on REFORM (with MESH_TEST_REFORM=1).
REFORM = r'''
def reform(gen):
    if os.environ.get("MESH_TEST_REFORM") != "1":
        return
    from torchpass import default_group
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    default_group.group().reconfigure(gen, rank, world, store, f"torchpass/gen{gen}/")
    put(f"reformed{gen}", True)
'''

_LAUNCH = """
import runpy, sys
if sys.argv[1] == "torchpass":
    from torchpass import default_group
    default_group.install(joining=False, collective=60.0)
runpy.run_path(sys.argv[2], run_name="__main__")
"""


def results(result_dir: Path) -> dict[int, dict]:
    """rank -> its results record, from the files the ranks wrote to result_dir."""
    found = {}
    for path in result_dir.glob("rank*.json"):
        rec = json.loads(path.read_text())
        found[rec["rank"]] = rec
    return found


def run_workers(tmp: Path, workload: str, world: int, torchpass: bool) -> dict[int, dict]:
    """Run ``workload`` on ``world`` processes; each must exit 0 and write its results."""
    script = tmp / "workload.py"
    script.write_text(workload)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                   MESH_TEST_REFORM="1" if torchpass else "0", MESH_RESULT_DIR=str(tmp))
        procs.append(subprocess.Popen([sys.executable, "-c", _LAUNCH, "torchpass" if torchpass else "plain",
                                       str(script)], env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True))
    try:
        failed = {}
        for r, p in enumerate(procs):
            _, stderr = p.communicate(timeout=300)
            # torch 2.13's gloo sometimes aborts in destroy_process_group, after the results
            teardown_abort = p.returncode == -6 and (tmp / f"rank{r}.json").exists()
            if p.returncode != 0 and not teardown_abort:
                failed[r] = f"rank {r} rc {p.returncode}: {stderr[-3000:]}"
        # the cause first: a rank whose error is not that a peer went away
        causes = [text for text in failed.values() if "Connection closed by peer" not in text]
        assert not failed, f"({'torchpass' if torchpass else 'plain'}) " + (causes or list(failed.values()))[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    found = results(tmp)
    assert sorted(found) == list(range(world))
    return found


def plain_and_reformed(tmp_path_factory: Any, workload: str, world: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """``workload`` on plain gloo (the reference), then with TorchPass groups re-formed between
    its phases: each rank's results from both runs."""
    plain = run_workers(tmp_path_factory.mktemp("plain"), workload, world, torchpass=False)
    reformed = run_workers(tmp_path_factory.mktemp("torchpass"), workload, world, torchpass=True)
    return plain, reformed
