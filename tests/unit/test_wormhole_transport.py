"""The wormhole's TCP streams over loopback: a peer that goes silent or stops reading is cut at the
io timeout with an error saying how far the transfer got, and closing a stream from another thread
frees a thread blocked in it at once (how a transfer is aborted)."""

from __future__ import annotations

import threading
import time

import pytest

from launchpad.wormhole import TcpTransport
from torchpass_common.errors import WormholeError


@pytest.fixture
def pair():
    """A connected (client, server) stream pair whose operations time out after 0.3 s."""
    transport = TcpTransport(io_timeout=0.3)
    listener = transport.listen("127.0.0.1", 0)
    client = transport.connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    assert server is not None
    yield client, server
    for s in (client, server, listener):
        s.close()


def test_a_peer_going_silent_mid_message_is_cut_at_the_io_timeout(pair):
    client, server = pair
    client.send(b"x" * 100)
    t0 = time.monotonic()
    with pytest.raises(WormholeError, match="receiving timed out after 100 of 1000 bytes"):
        server.recv_into(memoryview(bytearray(1000)))
    assert 0.25 < time.monotonic() - t0 < 3


def test_a_peer_that_stops_reading_is_cut_at_the_io_timeout(pair):
    client, _ = pair
    t0 = time.monotonic()
    with pytest.raises(WormholeError, match="sending timed out"):
        client.send(bytes(256 << 20))  # far more than both socket buffers hold
    assert time.monotonic() - t0 < 10


def test_a_longer_timeout_lets_a_slow_peer_finish(pair):
    client, server = pair
    server.set_timeout(5)
    threading.Timer(0.6, client.send, args=(b"y" * 10,)).start()  # twice the transport's io timeout
    buf = bytearray(10)
    server.recv_into(memoryview(buf))
    assert buf == b"y" * 10


def test_closing_a_stream_frees_a_thread_blocked_receiving_on_it(pair):
    _, server = pair
    server.set_timeout(30)
    errors: list[WormholeError] = []

    def receive() -> None:
        try:
            server.recv_into(memoryview(bytearray(1000)))
        except WormholeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.2)
    server.close()
    thread.join(timeout=2)
    assert not thread.is_alive() and len(errors) == 1
