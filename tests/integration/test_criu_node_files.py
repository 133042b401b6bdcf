"""A worker whose DataLoader uses the spawn start method holds named POSIX semaphores in /dev/shm
(every multiprocessing queue and lock): criu dumps them by name (``--link-remap``), but a spare's
/dev/shm does not have them. Here, with a real criu on this host: the tree is dumped, its /dev/shm
files collected, the original killed and its names removed (the spare's /dev/shm is empty of them),
and the restore works only once ``node_files.place`` has put them back, hard links and all: parent
and child then still share each semaphore, and their queues still carry every item once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from criu_hooks import node_files, runner, spawn
from criu_hooks.errors import CriuFailed
from torchpass_common.errors import ProtocolError

pytestmark = [pytest.mark.criu]

# A parent and its spawn-started child pass numbers back and forth through two queues (each one a
# pipe, two locks and a bounded semaphore: named semaphores in /dev/shm); each round is logged.
TREE = """
import multiprocessing as mp, sys, time
def double(q, r):
    while True:
        r.put(q.get() * 2)
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    ctx.Process(target=double, args=(q, r), daemon=True).start()
    i = 0
    while True:
        q.put(i)
        got = r.get(timeout=30)
        with open(sys.argv[1], "a") as log:
            log.write(f"{i} {got}\\n")
        i += 1
        time.sleep(0.02)
"""


def _rounds(path: Path) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (ln.split() for ln in path.read_text().splitlines() if ln.count(" ") == 1)]
    except (OSError, ValueError):
        return []


def _wait_rounds(path: Path, more_than: int, timeout: float = 20.0) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(rounds := _rounds(path)) > more_than:
            return rounds
        time.sleep(0.05)
    raise AssertionError(f"no round past {more_than} within {timeout} s: {_rounds(path)[-3:]}")


def _shm_names() -> set[str]:
    return {e.path for e in os.scandir(node_files.SHM)}


@pytest.fixture
def dumped(criu: None, tmp_path: Path):  # noqa: ANN201 - yields (images, collected, log)
    """The tree, dumped and collected, its original killed and its /dev/shm names released."""
    log = tmp_path / "rounds"
    before = _shm_names()
    script = tmp_path / "tree.py"  # a file: spawn's child imports its parent's main module
    script.write_text(TREE)
    launcher = spawn.start([sys.executable, str(script), str(log)], output=Path("/dev/null"))
    root = spawn.worker_pid(launcher)
    restored: list[int] = []
    try:
        _wait_rounds(log, 5)
        tree = runner.tree(root)
        images = tmp_path / "images"
        runner.dump(root, images, where={"test": "node-files"})
        collected = node_files.collect(tree, images)
        launcher.kill()  # first: unshare would write about its child's death into the output
        runner.discard_original(root)
        launcher.wait(10)
        node_files.release(collected)
        yield images, collected, log, restored
    finally:
        launcher.kill()
        for pid in [*restored, root]:
            for task in runner.tree(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(log)], check=False)
        for name in _shm_names() - before:
            os.unlink(name)


def test_a_spawn_tree_restores_with_its_semaphores_placed_again(dumped, tmp_path: Path) -> None:  # noqa: ANN001
    images, collected, log, restored = dumped
    names = {n for f in collected.files.shm for n in f.names}
    assert len(collected.files.shm) >= 4 and all(len(f.names) == 2 for f in collected.files.shm), collected
    assert {os.path.basename(n).split(".")[0] for n in names} == {"sem", "link_remap"}, names
    assert not names & _shm_names(), "the source's names went with its tree (as on another node)"
    done = len(_rounds(log))
    placed = node_files.place(node_files.NodeFiles.from_wire(collected.files.to_wire()), images)
    restored.append(runner.restore(images, where={"test": "node-files"}).pid)
    rounds = _wait_rounds(log, done + 10)
    assert [r for r, _ in rounds] == list(range(len(rounds))), "every round once, none lost, in order"
    assert all(got == 2 * i for i, got in rounds), "the child still answers through the shared semaphores"
    assert not {n for n in placed if os.path.basename(n).startswith(node_files.REMAP)} & _shm_names(), \
        "criu removes its link_remap names once restored"


def test_without_the_files_the_restore_fails_and_a_taken_name_is_refused(dumped) -> None:  # noqa: ANN001
    images, collected, _, _ = dumped
    with pytest.raises(CriuFailed):
        runner.restore(images, where={"test": "node-files"})
    first = collected.files.shm[0]
    taken = next(n for n in first.names if not os.path.basename(n).startswith(node_files.REMAP))
    Path(taken).write_bytes(b"someone else's")
    before = _shm_names()
    with pytest.raises(CriuFailed, match="exists on this node already"):
        node_files.place(collected.files, images)
    assert _shm_names() == before, "nothing of a refused placement is left behind"
    os.unlink(taken)


@pytest.mark.parametrize("bad", [
    {"shm": [{"names": ["/etc/passwd"], "copy": "shm-0", "mode": 0o600}], "socket_dirs": []},
    {"shm": [{"names": ["/dev/shm/../etc/x"], "copy": "shm-0", "mode": 0o600}], "socket_dirs": []},
    {"shm": [{"names": ["/dev/shm/sem.x"], "copy": "../../etc/shadow", "mode": 0o600}], "socket_dirs": []},
    {"shm": [], "socket_dirs": [["relative/dir", 0o700]]},
    {"shm": "nope"},
], ids=["outside-shm", "dot-dot", "copy-path", "relative-dir", "malformed"])
def test_node_files_from_the_network_are_checked(bad: dict) -> None:
    with pytest.raises(ProtocolError):
        node_files.NodeFiles.from_wire(bad)
