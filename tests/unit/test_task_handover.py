"""A srun python task hands itself over to its node's launchpad over a real abstract unix socket:
its environment and its stdout/stderr arrive, what launchpad writes there is the task's output, and
the task ends with the code launchpad sends. A stranger's or malformed hand-over is refused and the
real tasks still count; a task that never comes is named; a task whose launchpad is gone says so."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from pathlib import Path

import pytest

from torchpass_common import task_handover
from torchpass_common.errors import WorkerError


@pytest.fixture
def step(request: pytest.FixtureRequest) -> dict[str, str]:
    """A step of its own per test (the socket's name): job = this process, step = the test's hash."""
    return {"SLURM_JOB_ID": str(os.getpid()), "SLURM_STEP_ID": str(abs(hash(request.node.name)) % 10**6),
            "SLURMD_NODENAME": "n1"}


def _task(env: dict[str, str], out: Path, result: list[int], connect_s: float = 10.0) -> threading.Thread:
    """A task's side in a thread, its stdout/stderr being ``out``.stdout/.stderr files."""
    def run() -> None:
        with open(out.with_suffix(".stdout"), "wb") as so, open(out.with_suffix(".stderr"), "wb") as se:
            result.append(task_handover.hand_over(env, connect_s=connect_s, streams=(so.fileno(), se.fileno())))
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_task_hands_over_its_environment_and_streams_and_ends_with_launchpads_code(
        step: dict[str, str], tmp_path: Path) -> None:
    desk = task_handover.TaskDesk(step, expected=1)
    result: list[int] = []
    env = {**step, "SLURM_LOCALID": "1", "SLURM_PROCID": "1", "CUDA_VISIBLE_DEVICES": "1"}
    thread = _task(env, tmp_path / "t1", result)
    tasks = desk.gather(timeout=10)
    assert list(tasks) == [1] and tasks[1].env == env
    tasks[1].stdout.write(b"rank 1 step 0\n")
    tasks[1].stderr.write(b"a warning\n")
    desk.release(7)
    thread.join(10)
    assert result == [7]
    assert (tmp_path / "t1.stdout").read_bytes() == b"rank 1 step 0\n"
    assert (tmp_path / "t1.stderr").read_bytes() == b"a warning\n"


def _raw(step: dict[str, str], payload: bytes, fds: list[int] | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(task_handover.address(step))
    if fds:
        socket.send_fds(s, [payload], fds)
    else:
        s.sendall(payload)
    return s


def _frame(message: object) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


@pytest.mark.security
def test_malformed_hand_overs_are_refused_and_the_real_task_still_counts(
        step: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    desk = task_handover.TaskDesk(step, expected=1)
    r, w = os.pipe()
    strangers = [
        _raw(step, b"\x00\x00\x00\x05{not"),  # not JSON
        _raw(step, _frame({"local_id": 1, "env": {}})),  # no streams
        _raw(step, _frame({"local_id": 9, "env": {}}), [w, w]),  # no such task on this node
        _raw(step, _frame(["a", "list"]), [w, w]),
        _raw(step, b"\xff\xff\xff\xff"),  # a frame longer than any hand-over
    ]
    for s in strangers:
        s.shutdown(socket.SHUT_WR)
    result: list[int] = []
    thread = _task({**step, "SLURM_LOCALID": "1"}, tmp_path / "t1", result)
    tasks = desk.gather(timeout=10)
    desk.release(0)
    thread.join(10)
    assert list(tasks) == [1] and result == [0]
    for s in strangers:
        assert s.recv(100) == b""  # refused: closed without an exit code
        s.close()
    os.close(r)
    os.close(w)
    refused = capfd.readouterr().err
    assert refused.count("launchpad: refused a task hand-over on step") == len(strangers), refused


def test_a_task_that_never_comes_is_named(step: dict[str, str]) -> None:
    desk = task_handover.TaskDesk(step, expected=2)
    with pytest.raises(WorkerError, match=r"tasks \[1, 2\] of step .* on n1 did not hand themselves over"):
        desk.gather(timeout=0.3)
    desk.release(1)


def test_a_second_launchpad_for_the_same_step_is_refused(step: dict[str, str]) -> None:
    desk = task_handover.TaskDesk(step, expected=0)
    with pytest.raises(WorkerError, match="another launchpad already serves this step"):
        task_handover.TaskDesk(step, expected=0)
    desk.release(0)


def test_a_task_without_its_launchpad_ends_1_saying_why(step: dict[str, str], tmp_path: Path) -> None:
    result: list[int] = []
    _task({**step, "SLURM_LOCALID": "1"}, tmp_path / "t1", result, connect_s=0.3).join(10)
    assert result == [1]
    assert "no launchpad listens for task 1 on n1" in (tmp_path / "t1.stderr").read_text()


def test_a_task_whose_launchpad_dies_ends_1_saying_why(step: dict[str, str], tmp_path: Path) -> None:
    desk = task_handover.TaskDesk(step, expected=1)
    result: list[int] = []
    thread = _task({**step, "SLURM_LOCALID": "1"}, tmp_path / "t1", result)
    tasks = desk.gather(timeout=10)
    tasks[1].conn.close()  # launchpad killed: its end of the socket closes without a code
    thread.join(10)
    assert result == [1]
    assert "the launchpad of n1 ended without task 1's exit code" in (tmp_path / "t1.stderr").read_text()


def test_a_tasks_place_and_the_steps_variables() -> None:
    env = {"SLURM_NTASKS": "6", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "n[1-3]", "HOME": "/h"}
    assert task_handover.step_vars(env) == {"SLURM_NTASKS": "6", "SLURM_STEP_NODELIST": "n[1-3]"}
    assert task_handover.rank_vars(5, 1, 2) == {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"}
