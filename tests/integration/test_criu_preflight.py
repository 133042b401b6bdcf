"""Before anything is paused: a worker started the CRIU way is declared movable, and a worker started
any other way is refused with reasons that say what to change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from criu_hooks import preflight, spawn

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.criu
def test_worker_started_by_spawn_is_movable(tmp_path: Path) -> None:
    from criu_hooks import locate
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))
    launcher = spawn.start(SLEEPER, output=tmp_path / "out")
    worker = spawn.worker_pid(launcher)
    try:
        assert preflight.reasons(worker) == []
    finally:
        os.kill(worker, signal.SIGKILL)  # the namespace's init; unshare then exits by itself
        launcher.wait(timeout=10)


def test_plain_child_is_refused_with_what_to_change() -> None:
    child = subprocess.Popen(SLEEPER, stdin=subprocess.DEVNULL)
    try:
        found = " | ".join(preflight.reasons(child.pid))
        assert "not the first process of its own PID namespace" in found
        assert "not a session leader" in found and "criu_hooks.spawn" in found
    finally:
        child.kill()
        child.wait(timeout=10)


def test_vanished_process_is_refused() -> None:
    child = subprocess.Popen(SLEEPER)
    child.kill()
    child.wait(timeout=10)
    assert any("does not exist" in r for r in preflight.reasons(child.pid))


def test_device_paths_are_judged_by_whether_they_mean_the_same_on_the_spare() -> None:
    assert preflight.unportable("/dev/null") == preflight.unportable("/dev/shm/torch_1_2") == ""
    assert preflight.unportable("/dev/nvidia0") == ""  # GPUs: criu_hooks.cuda decides
    assert preflight.unportable("/tmp/train.log") == "" and preflight.unportable("socket:[12]") == ""
    assert "terminal" in preflight.unportable("/dev/pts/3")
    assert "cannot carry" in preflight.unportable("/dev/infiniband/uverbs0")


@pytest.mark.criu
def test_a_device_held_by_a_forked_child_is_named_before_any_pause(tmp_path: Path) -> None:
    """A DataLoader-style child of the worker holding a device file: preflight names the process and
    the device (criu would fail the dump, after the pause)."""
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg (the device this test holds open) is not readable here")
    holder = ("import os, time\nif os.fork() == 0:\n    f = open('/dev/kmsg', 'rb')\n    time.sleep(60)\n"
              "time.sleep(60)\n")
    launcher = spawn.start([sys.executable, "-c", holder], output=tmp_path / "out")
    worker = spawn.worker_pid(launcher)
    try:
        def named() -> list[str]:
            return [r for r in preflight.reasons(worker) if "/dev/kmsg" in r]
        for _ in range(100):  # until the child has opened it
            if found := named():
                break
            time.sleep(0.05)
        assert found and "a device that criu cannot carry to another node" in found[0], preflight.reasons(worker)
        assert not found[0].startswith(f"process {worker} "), "the child holds it, not the worker"
    finally:
        os.kill(worker, signal.SIGKILL)  # the namespace's init: its child goes with it
        launcher.wait(timeout=10)


# The worker forks a child that listens on ADDRESS (as a metrics exporter or a DataLoader's helper
# might) and on all addresses; the worker itself listens on ADDRESS too (as its process group does).
LISTENER = """
import os, socket, sys, time
def listen(host):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.bind((host, 0))
    s.listen()
    return s
keep = [listen(sys.argv[1])]
if os.fork() == 0:
    keep.pop().close()  # its copy of the worker's (as torchpass.severing.disown does for a process group's)
    keep += [listen(sys.argv[1]), listen("0.0.0.0"), listen("127.0.0.1")]
    print(keep[0].getsockname()[1], flush=True)
time.sleep(60)
"""


def _node_address() -> str:
    """One address of this machine that is neither loopback nor the wildcard."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    found = [a for a in found if not a.startswith("127.")]
    if not found:
        pytest.skip("this machine has no IPv4 address but loopback")
    return found[0]


def test_a_child_listening_on_one_address_of_this_node_is_named(tmp_path: Path) -> None:
    address = _node_address()
    out = tmp_path / "out"
    launcher = spawn.start([sys.executable, "-c", LISTENER, address], output=out)
    worker = spawn.worker_pid(launcher)
    try:
        deadline = time.monotonic() + 10
        while not out.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(out.read_text().split()[0])
        ((task, where),) = preflight.held_listeners(worker)  # the child's; not the worker's own, not 0.0.0.0
        assert (task, where) == (preflight.runner.tree(worker)[1], f"{address}:{port}")
        assert any(f"listens on {address}:{port}, an address of this node only" in r
                   for r in preflight.reasons(worker))
    finally:
        os.kill(worker, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", LISTENER[:40]], check=False)
        launcher.wait(timeout=10)
