"""sd_notify against a real datagram socket standing in for systemd's: the messages, the
abstract-namespace form, the watchdog cadence from WATCHDOG_USEC, and silence outside systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchpassd import sdnotify


@pytest.fixture
def systemd_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    yield sock
    sock.close()


def test_ready_status_and_stopping_reach_systemd(systemd_socket: socket.socket) -> None:
    assert sdnotify.ready("journal loaded, 2 jobs")
    assert systemd_socket.recv(4096) == b"READY=1\nSTATUS=journal loaded, 2 jobs"
    assert sdnotify.status("migrating job 12")
    assert systemd_socket.recv(4096) == b"STATUS=migrating job 12"
    assert sdnotify.stopping()
    assert systemd_socket.recv(4096) == b"STOPPING=1"


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"torchpass-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_outside_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.watchdog_interval() is None
    asyncio.run(asyncio.wait_for(sdnotify.watchdog_loop(), 1))  # returns at once


def test_watchdog_pings_at_half_the_interval_while_healthy(systemd_socket: socket.socket,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # WatchdogSec=0.2 -> a ping every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == pytest.approx(0.1)
    health = {"ok": True}

    async def run_for(seconds: float) -> float:
        start = time.monotonic()
        task = asyncio.create_task(sdnotify.watchdog_loop(lambda: health["ok"]))
        await asyncio.sleep(seconds)
        task.cancel()
        return time.monotonic() - start

    elapsed = asyncio.run(run_for(0.35))
    systemd_socket.settimeout(0.2)
    pings = []
    while True:
        try:
            pings.append(systemd_socket.recv(64))
        except TimeoutError:
            break
    assert set(pings) == {b"WATCHDOG=1"}
    assert 2 <= len(pings) <= elapsed / 0.1 + 1.5, (pings, elapsed)  # one at start, then every 0.1 s

    health["ok"] = False  # a sick daemon withholds the ping so systemd restarts it
    asyncio.run(run_for(0.25))
    with pytest.raises(TimeoutError):
        systemd_socket.recv(64)


def test_watchdog_meant_for_another_process_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert sdnotify.watchdog_interval() is None


def test_status_says_when_the_broker_goes_and_comes_back(systemd_socket: socket.socket) -> None:
    up = [True]

    async def run() -> list[bytes]:
        task = asyncio.create_task(sdnotify.broker_status_loop(lambda: up[0], "commands", interval=0.01))
        seen = [await asyncio.to_thread(systemd_socket.recv, 4096)]
        up[0] = False
        seen.append(await asyncio.to_thread(systemd_socket.recv, 4096))
        up[0] = True
        seen.append(await asyncio.to_thread(systemd_socket.recv, 4096))
        task.cancel()
        return seen

    first, down, back = asyncio.run(run())
    assert first == back == b"STATUS=watching Slurm through commands; broker connected"
    assert down.startswith(b"STATUS=watching Slurm through commands; broker unreachable since ")
    assert down.endswith(b": reconnecting; no node is declared dead meanwhile")
