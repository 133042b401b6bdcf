"""A receiver under a connection flood on loopback: 2,000 strangers connect at once and hold their
connections (silent, sending garbage, or trickling a hello byte by byte) while a real sender moves
a few MB. The receiver challenges at most MAX_HANDSHAKES of them at a time, each within its
deadline, closes the rest at once (logged once a second, not per connection); the real transfer
arrives bit for bit and the receiving process's thread count stays bounded."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import secrets
import socket
import threading
import time

import pytest
import structlog
import torch

from launchpad.wormhole import StateReceiver, send_state
from launchpad.wormhole.receiver import MAX_HANDSHAKES
from torchpass_common import log

pytestmark = [pytest.mark.security]
TOKEN = secrets.token_bytes(32)
STRANGERS = 2000
HANDSHAKE_S = 2.0


class Flood:
    """``STRANGERS`` non-blocking connections to ``port``: a quarter send garbage once connected, a
    quarter trickle the wormhole magic one byte every 0.4 s, the rest stay silent; all are held
    open until close()."""

    def __init__(self, port: int) -> None:
        self.socks: list[socket.socket] = []
        for _ in range(STRANGERS):
            s = socket.socket()
            s.setblocking(False)
            code = s.connect_ex(("127.0.0.1", port))
            assert code in (0, errno.EINPROGRESS), os.strerror(code)
            self.socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._talk, daemon=True, name="test-flood")
        self._thread.start()

    def _talk(self) -> None:
        garbage = [s for i, s in enumerate(self.socks) if i % 4 == 1]
        tricklers = [s for i, s in enumerate(self.socks) if i % 4 == 2]
        sent_garbage: set[int] = set()
        tick = 0
        while not self._stop.wait(0.4):
            for s in garbage:
                if s.fileno() not in sent_garbage:
                    with contextlib.suppress(OSError):
                        s.send(b"\x16\x03\x01\x02\x00GET / HTTP/1.1\r\n" + os.urandom(64))
                        sent_garbage.add(s.fileno())
            for s in tricklers:
                with contextlib.suppress(OSError):
                    s.send(b"TPWH"[tick % 4:tick % 4 + 1])
            tick += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def _fd_room() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = STRANGERS * 2 + 500  # both ends live in this process
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files, the hard limit here is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def test_a_flood_of_strangers_neither_exhausts_threads_nor_stops_a_real_transfer():
    _fd_room()
    log.setup()
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randint(0, 1 << 30, (65536,), generator=g),
             "step": 12}  # 4.25 MB
    baseline = threading.active_count()
    peak = [baseline]
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.01):
            peak[0] = max(peak[0], threading.active_count())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs, \
            StateReceiver("127.0.0.1", 0, TOKEN, handshake_timeout=HANDSHAKE_S) as rx:
        pending = rx.start(timeout=25)
        flood = Flood(rx.port)
        try:
            time.sleep(1.5)  # the flood has filled every handshake slot
            send_state(state, "127.0.0.1", rx.port, TOKEN, timeout=25)
            got = pending.result(timeout=25)
            elapsed = time.monotonic() - t0
        finally:
            flood.close()
            watching.set()
            watcher.join(5)

    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 12
    # receiver: acceptor + receive thread + at most MAX_HANDSHAKES handshakes; sender: its 2 stream
    # threads; the flood's own thread and this test's watcher; a few spare for thread turnover
    assert peak[0] - baseline <= MAX_HANDSHAKES + 10, f"{peak[0] - baseline} threads above the baseline"
    assert rx.shed > STRANGERS // 4, rx.shed  # many were closed at once, unauthenticated (how many: timing)
    shed_logs = [e for e in logs if e["event"] == "wormhole.shed"]
    assert sum(e["connections"] for e in shed_logs) == rx.shed
    assert len(shed_logs) <= elapsed / 1.0 + 2, f"{len(shed_logs)} shed logs in {elapsed:.1f} s"
    assert elapsed < 25, elapsed
    retried = sum(e["event"] == "wormhole.retrying" for e in logs)
    print(f"flood: {elapsed:.1f} s, {rx.shed} shed, {len(rx.refused)} refused, peak {peak[0] - baseline} threads "
          f"above {baseline}, {len(shed_logs)} shed logs, {retried} streams retried")
