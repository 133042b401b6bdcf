"""launchpad supervising workers like torchrun: the first failure stops the others and launchpad
exits non-zero naming the failed rank; SIGTERM/SIGINT reach every worker (SIGKILL after the grace
period); --max-restarts restarts the whole group with TORCHELASTIC_RESTART_COUNT raised; -m and
--no-python run modules and executables; a failed node makes the other node stop too."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import test_launchpad_training as lt
from test_launchpad_training import Procs, free_port, launchpad_argv, write_script

procs = lt.procs  # the shared fixture: processes started by a test are killed by PID at teardown
# Supervision tests below start their workers with --no-python (plain Python, no torch import), which
# keeps them fast on a busy machine; the first test and -m go through the torchpass bootstrap.
LIGHT = ("--no-python", lt.PYTHON)

# argv: FAIL_RANK EXIT_CODE [HEALED_AT_RESTART]. Each worker says hello and reports the signal that
# stops it (exit 7); FAIL_RANK exits with EXIT_CODE after 0.3 s, the others would wait a minute;
# from restart HEALED_AT_RESTART on, every worker exits 0 after 0.3 s.
WORKER = '''
import os, signal, sys, time
rank, restart = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
def stop(sig, frame):
    print(f"rank {rank} got {signal.Signals(sig).name}", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print(f"rank {rank} up restart={restart}", flush=True)
if int(restart) >= (int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 30):
    time.sleep(0.3)
    sys.exit(0)
if rank == int(sys.argv[1]):
    time.sleep(0.3)
    sys.exit(int(sys.argv[2]))
time.sleep(60)
'''


def wait_for_line(proc, text: str, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"launchpad never printed {text!r}")


@pytest.mark.slow
def test_first_failure_stops_the_others_and_sets_the_exit_code(procs: Procs, tmp_path: Path) -> None:
    script = write_script(tmp_path, WORKER, "worker.py")
    res = procs.run(launchpad_argv("--standalone", "--nproc-per-node=3", str(script), "1", "3"), timeout=60)
    assert res.returncode == 3
    assert "worker rank 1 exited with code 3" in res.stderr
    assert {"rank 0 got SIGTERM", "rank 2 got SIGTERM"} <= set(res.stdout.splitlines())  # no prefix, like torchrun


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_worker(procs: Procs, tmp_path: Path, sig: signal.Signals) -> None:
    script = write_script(tmp_path, WORKER, "worker.py")
    proc = procs.start(launchpad_argv("--standalone", "--nproc-per-node=2", *LIGHT, str(script), "-1", "0"))
    wait_for_line(proc, "up restart=0")
    wait_for_line(proc, "up restart=0")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert f"rank 0 got {sig.name}" in out and f"rank 1 got {sig.name}" in out


@pytest.mark.slow
def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(procs: Procs, tmp_path: Path) -> None:
    script = write_script(tmp_path, "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                    "print('up', flush=True)\ntime.sleep(60)\n", "stubborn.py")
    proc = procs.start(launchpad_argv("--standalone", "--grace-period=1", *LIGHT, str(script)))
    wait_for_line(proc, "up")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert 0.9 < time.monotonic() - t0 < 10


@pytest.mark.slow
def test_max_restarts_restarts_the_group(procs: Procs, tmp_path: Path) -> None:
    script = write_script(tmp_path, WORKER, "worker.py")
    # rank 0 fails in restarts 0 and 1 and is fine in restart 2; everybody then exits 0 quickly
    res = procs.run(launchpad_argv("--standalone", "--nproc-per-node=2", "--max-restarts=2", *LIGHT,
                                   str(script), "0", "5", "2"), timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 1 up restart=2" in res.stdout.splitlines()
    res = procs.run(launchpad_argv("--standalone", "--nproc-per-node=2", "--max-restarts=1", *LIGHT,
                                   str(script), "0", "5", "2"), timeout=90)
    assert res.returncode == 5


@pytest.mark.slow
def test_module_and_no_python(procs: Procs, tmp_path: Path) -> None:
    write_script(tmp_path, "import os\nprint('module rank', os.environ['RANK'], flush=True)\n", "lpmod.py")
    res = procs.run(launchpad_argv("--standalone", "-m", "--nproc-per-node=2", "lpmod"),
                    env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "module rank 1" in res.stdout.splitlines()
    res = procs.run(launchpad_argv("--standalone", "--nproc-per-node=2", "--local-ranks-filter=1", "--no-python",
                                   "sh", "-c", 'echo "sh rank $RANK"; exit $((RANK * 4))'))
    assert res.returncode == 4 and res.stdout.splitlines() == ["sh rank 1"]


@pytest.mark.slow
def test_failure_on_one_node_stops_the_other(procs: Procs, tmp_path: Path) -> None:
    script = write_script(tmp_path, WORKER, "worker.py")
    common = ["--nnodes=2", f"--master-port={free_port()}", "--nproc-per-node=1"]
    nodes = [procs.start(launchpad_argv(*common, f"--node-rank={n}", *LIGHT, str(script), "1", "9")) for n in (0, 1)]
    for n in nodes:
        n.communicate(timeout=60)
    assert nodes[1].returncode == 9  # the node whose worker failed
    assert nodes[0].returncode == 1  # the other node stopped its healthy worker


@pytest.mark.slow
def test_sigterm_while_waiting_for_the_other_nodes_stops_at_once(procs: Procs, tmp_path: Path) -> None:
    proc = procs.start(launchpad_argv("--nnodes=2", "--node-rank=0", f"--master-port={free_port()}", "--no-python",
                                      "true"), log=tmp_path / "launchpad.log",
                       env={"TORCHPASS_LOG_LEVEL": "info"})  # its info events on the console too
    log = tmp_path / "launchpad.log"
    deadline = time.monotonic() + 60
    while "rendezvous.hosting" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "rendezvous cancelled" in log.read_text()
