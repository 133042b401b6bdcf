"""The "only changes" GPU telemetry in heartbeats: deltas carry only what changed, the decoder
rebuilds exactly what the node sampled (through the real heartbeat schema and msgpack), waits
for a keyframe after a lost heartbeat instead of guessing, and rejects malformed input."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launchpad.telemetry.encoding import DeltaDecoder, DeltaEncoder
from torchpass_common import protocol
from torchpass_common.errors import ProtocolError


def sample(t: float, **gpu0: Any) -> dict[str, Any]:
    base = {"uuid": "GPU-a", "name": "H100", "answering": True, "temp_c": 60, "power_w": 400.5,
            "ecc_vol_corr": 0, "nvlink_replay": 0, "throttle": ""}
    return {"t": t, "nvml": "nvml", "gpus": {"0": {**base, **gpu0}, "1": {**base, "uuid": "GPU-b"}}}


def over_the_wire(part: dict[str, Any]) -> dict[str, Any]:
    """Through a real heartbeat message, as launchpad sends it and torchpassd decodes it."""
    payload = protocol.encode(protocol.HEARTBEAT, job="7", gen=1,
                              body={"node": "n1", "seq": 1, "workers": [], "gpu": part})
    return protocol.decode(payload).body["gpu"]


def test_a_delta_carries_only_what_changed_and_is_much_smaller() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    first = over_the_wire(enc.encode(sample(0.0)))
    second = over_the_wire(enc.encode(sample(5.0, temp_c=61)))
    assert second == {"s": 2, "b": 1, "t": 5.0, "g": {"0": {"temp_c": 61}}}
    assert len(msgpack.packb(second)) * 5 < len(msgpack.packb(first))
    assert dec.apply(first) == sample(0.0)
    assert dec.apply(second) == sample(5.0, temp_c=61)
    quiet = enc.encode(sample(10.0, temp_c=61))
    assert quiet == {"s": 3, "b": 2, "t": 10.0}  # nothing changed: only the time moves on
    assert dec.apply(quiet)["t"] == 10.0


def test_vanished_fields_and_gpus_are_removed() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    dec.apply(enc.encode(sample(0.0)))
    lost = sample(5.0)
    lost["gpus"]["0"] = {"uuid": "GPU-a", "name": "H100", "answering": False, "error": "GPU is lost"}
    del lost["gpus"]["1"]
    assert dec.apply(over_the_wire(enc.encode(lost))) == lost


def test_after_a_lost_heartbeat_the_decoder_waits_for_the_next_keyframe() -> None:
    enc, dec = DeltaEncoder(keyframe_every=4), DeltaDecoder()
    parts = [enc.encode(sample(float(i), ecc_vol_corr=i * 10)) for i in range(9)]
    assert dec.apply(parts[0])["gpus"]["0"]["ecc_vol_corr"] == 0
    # parts[1] is lost (QoS 0): parts[2] and [3] cannot be applied safely
    assert dec.apply(parts[2]) is None and dec.apply(parts[3]) is None and dec.gaps == 1
    assert "b" not in parts[4]  # a keyframe every 4
    assert dec.apply(parts[4]) == sample(4.0, ecc_vol_corr=40)
    assert dec.apply(parts[5]) == sample(5.0, ecc_vol_corr=50)


def test_a_restarted_launchpad_starts_with_a_keyframe() -> None:
    dec = DeltaDecoder()
    old = DeltaEncoder()
    for i in range(3):
        dec.apply(old.encode(sample(float(i))))
    assert dec.apply(DeltaEncoder().encode(sample(9.0, temp_c=70))) == sample(9.0, temp_c=70)


@pytest.mark.parametrize("bad", [
    None, [], {"s": "1", "t": 0.0}, {"s": 1, "t": 0.0}, {"s": 1, "t": 0.0, "n": "nvml", "g": []},
    {"s": 1, "t": 0.0, "n": "nvml", "g": {"0": {"temp": [1, 2]}}}, {"s": 2, "b": "1", "t": 0.0},
    {"s": 2, "b": 1, "t": 0.0, "x": {"0": "temp_c"}}, {"s": 2, "b": 1, "t": 0.0, "x": []},
])
def test_malformed_telemetry_is_a_protocol_error(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="malformed GPU telemetry"):
        DeltaDecoder().apply(bad)


_value = st.one_of(st.integers(-2**31, 2**31), st.booleans(), st.text(max_size=8),
                   st.floats(allow_nan=False, allow_infinity=False))
_gpu = st.dictionaries(st.sampled_from(["temp_c", "power_w", "ecc_vol_corr", "xid_79", "error", "answering"]),
                       _value, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["0", "1", "2"]), _gpu, max_size=3), min_size=1, max_size=12))
def test_any_sequence_of_samples_decodes_exactly(gpu_states: list[dict[str, Any]]) -> None:
    enc, dec = DeltaEncoder(keyframe_every=5), DeltaDecoder()
    for i, gpus in enumerate(gpu_states):
        s = {"t": float(i), "nvml": "nvml", "gpus": copy.deepcopy(gpus)}
        assert dec.apply(over_the_wire(enc.encode(s))) == s
