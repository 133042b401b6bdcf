"""protocol.py: topics, encoding, and the strict decoder's rejections (each with a clear reason)."""

from __future__ import annotations

import math

import msgpack
import pytest

from torchpass_common import protocol
from torchpass_common.errors import ProtocolError

BODIES = {
    protocol.HEARTBEAT: {"node": "n1", "seq": 7, "workers": [{"rank": 0, "step": 12, "state": "running"}]},
    protocol.STATE: {"node": "n1", "online": True},
    protocol.COMMAND: {"cmd": "pause", "migration": "m1", "args": {"at_step": 40}},
    protocol.ACK: {"command_id": "ab" * 16, "cmd": "pause", "migration": "m1", "ok": True,
                   "error": None, "result": {"step": 40}},
    protocol.EVENT: {"event": "migration.phase", "phase": "paused", "seconds": 0.04},
}


def envelope(**over: object) -> dict:
    env = {"v": protocol.SCHEMA_VERSION, "kind": "state", "job": "123", "gen": 1, "id": "0" * 32,
           "ts": 1.5, "body": {"node": "n1", "online": True}}
    env.update(over)
    return env


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_every_kind_round_trips(kind: str) -> None:
    msg = protocol.decode(protocol.encode(kind, job="4711", gen=3, body=BODIES[kind]))
    assert (msg.kind, msg.job, msg.gen, msg.body) == (kind, "4711", 3, BODIES[kind])
    assert msg.v == protocol.SCHEMA_VERSION and len(msg.id) == 32 and math.isfinite(msg.ts)


def test_message_ids_are_unique() -> None:
    ids = {protocol.decode(protocol.encode("state", job="1", gen=0, body=BODIES["state"])).id
           for _ in range(100)}
    assert len(ids) == 100


def test_topics_follow_the_tree_and_parse_back() -> None:
    assert protocol.hb_topic("42", "n3") == "torchpass/v1/jobs/42/nodes/n3/hb"
    assert protocol.cmd_topic("42", "n3") == "torchpass/v1/jobs/42/nodes/n3/cmd"
    assert protocol.events_topic("42") == "torchpass/v1/jobs/42/events"
    assert protocol.nodes_filter("heartbeat") == "torchpass/v1/jobs/+/nodes/+/hb"
    assert protocol.nodes_filter("ack", job="42") == "torchpass/v1/jobs/42/nodes/+/ack"
    assert protocol.job_filter("42") == "torchpass/v1/jobs/42/#"
    for build, kind in [(protocol.hb_topic, "heartbeat"), (protocol.state_topic, "state"),
                        (protocol.cmd_topic, "command"), (protocol.ack_topic, "ack")]:
        assert protocol.parse_topic(build("42", "n3")) == ("42", "n3", kind)
    assert protocol.parse_topic(protocol.events_topic("42")) == ("42", None, "event")


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "n 1", "x" * 129, "\x00"])
def test_names_that_would_break_the_topic_tree_are_refused(bad: str) -> None:
    with pytest.raises(ProtocolError, match="invalid job name"):
        protocol.hb_topic(bad, "n1")
    with pytest.raises(ProtocolError, match="invalid node name"):
        protocol.cmd_topic("1", bad)


@pytest.mark.parametrize("topic", ["torchpass/v1/jobs/1/nodes/n1/other", "torchpass/v2/jobs/1/events",
                                   "torchpass/v1/jobs/1/nodes/n1", "torchpass/v1/jobs/1/nodes/n1/events"])
def test_foreign_topics_do_not_parse(topic: str) -> None:
    with pytest.raises(ProtocolError, match="not a TorchPass v1 topic"):
        protocol.parse_topic(topic)


MALFORMED = [
    (b"\xc1", "not valid msgpack"),
    (pack([1, 2]), "must be a msgpack map"),
    (pack(envelope()) + b"\x00", "not valid msgpack"),
    (pack(envelope(v=2)), "unsupported schema version 2"),
    (pack(envelope(kind="gossip")), "unknown message kind 'gossip'"),
    (pack({k: v for k, v in envelope().items() if k != "gen"}), "lacks required field 'gen'"),
    (pack(envelope(gen=True)), "'gen' must be int, got bool"),
    (pack(envelope(gen=-1)), "generation must be >= 0"),
    (pack(envelope(ts=float("nan"))), "not a finite number"),
    (pack(envelope(id="not-hex")), "is not 32 lowercase hex"),
    (pack(envelope(job="a/b")), "invalid job name"),
    (pack(envelope(extra=1)), "unknown envelope field"),
    (pack(envelope(body={"node": "n1"})), "state body lacks required field 'online'"),
    (pack(envelope(body={"node": "n1", "online": 1})), "'online' must be bool, got int"),
    (pack(envelope(kind="command", body={"cmd": "rm -rf", "migration": "m", "args": {}})), "unknown command"),
    (pack(envelope(kind="heartbeat", body={"node": "n", "seq": 1, "workers": [{"rank": 0}]})),
     r"workers\[0\] lacks required field 'step'"),
    (pack(envelope(kind="ack", body={**BODIES["ack"], "error": 5})), "'error' must be str or nil"),
    (pack({1: 2}), "not valid msgpack"),
    (pack(envelope(body={"node": "n1", "online": True, "x": msgpack.ExtType(5, b"xx")})),
     "extension type 5"),
    (pack(envelope(body={"node": "n1", "online": True, "t": msgpack.Timestamp(1, 0)})), "Timestamp"),
    (pack(envelope(body={"node": "n1", "online": True, "deep": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]})),
     "nests deeper"),
    (b"\x91" * 100_000, "exceeds the limit"),
]


@pytest.mark.parametrize("payload, reason", MALFORMED, ids=[reason for _, reason in MALFORMED])
def test_malformed_messages_are_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(payload)


def test_oversized_message_is_refused_before_parsing() -> None:
    big = pack(envelope(body={"node": "n1", "online": True, "pad": "x" * protocol.MAX_MESSAGE_BYTES}))
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {protocol.MAX_MESSAGE_BYTES} bytes"):
        protocol.decode(big)


def test_sender_mistakes_fail_at_encode_time() -> None:
    with pytest.raises(ProtocolError, match="unknown command 'teleport'"):
        protocol.encode("command", job="1", gen=1, body={"cmd": "teleport", "migration": "m", "args": {}})
    with pytest.raises(ProtocolError, match="exceeds the limit") as err:
        protocol.encode("event", job="1", gen=1, body={"event": "x", "blob": b"\0" * protocol.MAX_MESSAGE_BYTES})
    assert "wormhole" in str(err.value)


def test_errors_name_job_and_generation() -> None:
    with pytest.raises(ProtocolError) as err:
        protocol.decode(pack(envelope(kind="command", job="77", gen=4, body={"cmd": "pause"})))
    assert "job=77" in str(err.value) and "gen=4" in str(err.value)
