"""The wormhole against hostile or broken peers over loopback: wrong tokens, strangers, port
scans, silent squatters on every handshake slot, a peer trickling its hello, a fake receiver, a
stream cut in the middle and a flipped byte. Each gives a clear error or a logged refusal, and
nothing partial is ever loaded."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from pathlib import Path

import pytest
import structlog
import torch

from launchpad.wormhole import File, StateReceiver, send_state
from torchpass_common import log
from torchpass_common.errors import WormholeError

TOKEN = secrets.token_bytes(32)


class Relay:
    """A TCP relay in front of a receiver that cuts connection ``conn`` after ``cut_after``
    sender->receiver bytes, or flips the byte at ``flip_at`` (a broken cable, a bad NIC)."""

    def __init__(self, target_port: int, *, conn: int, cut_after: int | None = None,
                 flip_at: int | None = None) -> None:
        self._target, self._conn, self._cut, self._flip = target_port, conn, cut_after, flip_at
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        index = 0
        while True:
            try:
                down, _ = self._server.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [down, up]
            faulty = index == self._conn
            threading.Thread(target=self._pump, args=(down, up, faulty), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()
            index += 1

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if faulty and self._cut is not None and seen + len(data) >= self._cut:
                    dst.sendall(data[:self._cut - seen])
                    break
                if faulty and self._flip is not None and seen <= self._flip < seen + len(data):
                    data = bytearray(data)
                    data[self._flip - seen] ^= 0x10
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for s in self._socks:
            s.close()


def _state() -> dict:
    return {"w": torch.randn(512, 1024), "b": torch.randn(1024), "step": 3}


def _template() -> dict:
    return {"w": torch.full((512, 1024), 7.0), "b": torch.full((1024,), 7.0), "step": 0}


def _hung_up(sock: socket.socket) -> bool:
    """True when the peer closed on us without sending anything (FIN, or RST if bytes were unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def logs():
    log.setup()
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.mark.security
def test_sender_with_wrong_token_is_refused_and_nothing_loaded(logs):
    template = _template()
    with StateReceiver("127.0.0.1", 0, TOKEN, template=template) as rx:
        pending = rx.start(timeout=1)
        with pytest.raises(WormholeError, match="receiver failed authentication"):
            send_state(_state(), "127.0.0.1", rx.port, secrets.token_bytes(32))
        with pytest.raises(WormholeError, match=r"no authenticated sender .*1 peers refused"):
            pending.result(timeout=10)
    assert torch.equal(template["w"], torch.full((512, 1024), 7.0))
    assert any(e["event"] == "wormhole.refused" and "challenge" in e["reason"] for e in logs)


@pytest.mark.security
def test_strangers_are_refused_and_logged_while_the_real_sender_gets_through(logs):
    state = _state()
    with StateReceiver("127.0.0.1", 0, TOKEN, handshake_timeout=1.0) as rx:
        pending = rx.start(timeout=20)
        squatter = socket.create_connection(("127.0.0.1", rx.port))  # connects, says nothing
        with socket.create_connection(("127.0.0.1", rx.port)):
            pass  # port scan: connect and close
        with socket.create_connection(("127.0.0.1", rx.port)) as garbage:
            garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
            assert _hung_up(garbage)  # refused: closed without a word
        with socket.create_connection(("127.0.0.1", rx.port)) as forger:
            forger.sendall(b"TPWH\x00\x01" + bytes(32))  # right magic, then a forged answer
            forger.recv(70)
            forger.sendall(bytes(20 + 32))
            assert _hung_up(forger)
        send_state(state, "127.0.0.1", rx.port, TOKEN)
        got = pending.result(timeout=20)
        squatter.close()
    assert torch.equal(got["w"], state["w"])
    reasons = " | ".join(rx.refused)
    assert "no complete hello" in reasons and "bad magic" in reasons and "wrong token" in reasons
    refused = [e for e in logs if e["event"] == "wormhole.refused"]
    assert len(refused) == len(rx.refused) >= 3 and all(e["log_level"] == "warning" for e in refused)


@pytest.mark.security
def test_squatters_holding_every_handshake_slot_delay_the_sender_only_until_their_deadline(logs):
    """max_handshakes squatters say nothing: the sender's streams are closed at once (shed, logged
    as a count), it tries again, and gets through once the squatters' deadline freed the slots."""
    state = _state()
    with StateReceiver("127.0.0.1", 0, TOKEN, handshake_timeout=1.0, max_handshakes=2) as rx:
        pending = rx.start(timeout=20)
        squatters = [socket.create_connection(("127.0.0.1", rx.port)) for _ in range(2)]
        time.sleep(0.3)  # both are being challenged
        t0 = time.monotonic()
        send_state(state, "127.0.0.1", rx.port, TOKEN, timeout=20)
        waited = time.monotonic() - t0
        got = pending.result(timeout=20)
        for s in squatters:
            s.close()
    assert torch.equal(got["w"], state["w"])
    assert rx.shed >= 1 and 0.3 < waited < 5, (rx.shed, waited)
    assert sum(e["connections"] for e in logs if e["event"] == "wormhole.shed") == rx.shed
    assert any(e["event"] == "wormhole.retrying" for e in logs)
    assert sum("no complete hello" in r for r in rx.refused) == 2


@pytest.mark.security
def test_a_peer_trickling_its_hello_is_cut_at_the_handshake_deadline():
    """One byte every 0.2 s never trips the per-read timeout; the whole handshake's deadline does."""
    with StateReceiver("127.0.0.1", 0, TOKEN, handshake_timeout=1.0) as rx:
        pending = rx.start(timeout=20)
        trickler = socket.create_connection(("127.0.0.1", rx.port))
        t0 = time.monotonic()
        cut = None
        for byte in b"TPWH\x00\x01" + bytes(32):
            try:
                trickler.sendall(bytes([byte]))
            except OSError:
                cut = time.monotonic() - t0
                break
            time.sleep(0.2)
        trickler.close()
        send_state(_state(), "127.0.0.1", rx.port, TOKEN)
        pending.result(timeout=20)
    assert cut is not None and cut < 3, cut  # the 38-byte hello would take 7.6 s
    assert any("no complete hello" in r and "handshake deadline of 1 s passed" in r for r in rx.refused), rx.refused


@pytest.mark.security
def test_sender_sends_no_state_to_a_receiver_without_the_token():
    received = bytearray()
    fake = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = fake.accept()
        with conn:
            received.extend(conn.recv(1000))
            conn.sendall(b"TPWH\x00\x01" + secrets.token_bytes(64))  # a challenge with a bogus proof
            conn.settimeout(2)
            try:
                while chunk := conn.recv(1 << 16):
                    received.extend(chunk)
            except OSError:
                pass

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(WormholeError, match="receiver failed authentication.*nothing was sent"):
        send_state(_state(), "127.0.0.1", fake.getsockname()[1], TOKEN)
    t.join(10)
    fake.close()
    assert len(received) == 38  # the hello (magic, version, nonce) and not one byte more


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["cut", "flip"])
def test_torn_or_corrupted_stream_leaves_template_and_files_untouched(fault, tmp_path: Path):
    image = tmp_path / "pages.img"
    image.write_bytes(secrets.token_bytes(200_000))
    dst = tmp_path / "dst"
    dst.mkdir()
    template = _template()
    state = {**_state(), "image": File(image)}
    fault_args = {"cut_after": 900_000} if fault == "cut" else {"flip_at": 1_200_000}
    with StateReceiver("127.0.0.1", 0, TOKEN, template=template, files_dir=dst) as rx:
        relay = Relay(rx.port, conn=1, **fault_args)
        pending = rx.start(timeout=20)
        with pytest.raises(WormholeError) as sent:
            send_state(state, "127.0.0.1", relay.port, TOKEN, chunk_bytes=256 << 10)
        with pytest.raises(WormholeError) as received:
            pending.result(timeout=20)
        relay.close()
    expected = "stream cut" if fault == "cut" else "checksum mismatch in ["
    assert expected in str(received.value)
    assert "nothing was loaded" in str(received.value)
    assert "stream cut" in str(sent.value) or expected in str(sent.value) or "failed" in str(sent.value)
    assert torch.equal(template["w"], torch.full((512, 1024), 7.0))
    assert torch.equal(template["b"], torch.full((1024,), 7.0))
    assert list(dst.iterdir()) == []


@pytest.mark.faults
def test_in_place_failure_says_the_template_holds_partial_data():
    with StateReceiver("127.0.0.1", 0, TOKEN, template=_template(), in_place=True) as rx:
        relay = Relay(rx.port, conn=0, flip_at=600_000)
        pending = rx.start(timeout=20)
        with pytest.raises(WormholeError):
            send_state(_state(), "127.0.0.1", relay.port, TOKEN, chunk_bytes=256 << 10)
        with pytest.raises(WormholeError, match="checksum mismatch.*partial data: rebuild them"):
            pending.result(timeout=20)
        relay.close()


def test_receiver_without_sender_times_out_clearly():
    with StateReceiver("127.0.0.1", 0, TOKEN) as rx, \
            pytest.raises(WormholeError, match=r"no authenticated sender within the timeout \(0 of 2"):
        rx.receive(timeout=0.3)


def test_short_token_and_unreachable_receiver_are_clear_errors():
    with pytest.raises(WormholeError, match="at least 16 bytes"):
        StateReceiver("127.0.0.1", 0, b"short")
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(WormholeError, match=f"cannot connect to wormhole receiver 127.0.0.1:{port}"):
        send_state({}, "127.0.0.1", port, TOKEN, context={"migration": "m1", "rank": 3})


def test_stream_count_mismatch_is_explained_to_the_sender():
    with StateReceiver("127.0.0.1", 0, TOKEN, streams=2) as rx:
        pending = rx.start(timeout=1)
        with pytest.raises(WormholeError, match="receiver refused this stream: sender uses 3 streams, "
                                                "receiver expects 2"):
            send_state(_state(), "127.0.0.1", rx.port, TOKEN, streams=3)
        with pytest.raises(WormholeError, match="no authenticated sender"):
            pending.result(timeout=10)
