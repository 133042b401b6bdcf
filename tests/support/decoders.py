"""The decoders that read bytes from outside the process (the MQTT message decoder, launchpad's
worker-channel frames, the GPU telemetry deltas in heartbeats, torchpassd's control-socket lines,
the wormhole's state skeleton), each as a function of raw bytes, with valid inputs to corrupt; and
REFUSALS, the errors by which they refuse. The fuzz tests feed them hostile input."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import numpy as np
import torch

from launchpad.telemetry.encoding import DeltaDecoder
from launchpad.wormhole.layout import flatten, unflatten
from torchpass_common import agent_channel, protocol
from torchpass_common.errors import ProtocolError, WormholeError
from torchpassd.control_socket import ControlSocketError, decode_line

REFUSALS = (ProtocolError, ControlSocketError, WormholeError)

VALID = [  # valid MQTT messages, a worker-channel frame, telemetry; a control-socket line last
    protocol.encode(protocol.HEARTBEAT, job="9", gen=2,
                    body={"node": "n1", "seq": 3, "workers": [{"rank": 0, "step": 5, "state": "run"}]}),
    protocol.encode(protocol.COMMAND, job="9", gen=2, body={"cmd": "pause", "migration": "m1", "args": {"at_step": 4}}),
    agent_channel.encode(agent_channel.message(agent_channel.RESUME, gen=3))[4:],
    msgpack.packb({"s": 1, "t": 1.5, "n": "nvml", "g": {"0": {"temp": 40, "ecc": 0}}}),
    b'{"op":"status","args":{}}',
]
SKELETON = flatten({"rng": np.random.RandomState(3).get_state(), "step": (7, 2**70), "ids": {1, 2},
                    "w": torch.ones(2)})[0]  # what a wormhole sender sends first


def _protocol(data: bytes) -> None:
    protocol.decode(data)


def _agent_channel(data: bytes) -> None:
    agent_channel._decode_body(data)  # what AsyncChannel/SyncChannel run on each frame body


def _telemetry(data: bytes) -> None:
    try:
        msg = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError("not msgpack") from exc  # protocol.decode refuses these before telemetry sees them
    DeltaDecoder().apply(msg)


def _skeleton(data: bytes) -> None:
    unflatten(data, [None] * 4)  # a receiver's leaves are its own tensors; only the skeleton is foreign


def _control_line(data: bytes) -> None:
    decode_line(data)  # ControlSocketError is a ProtocolError's sibling: both TorchPassError


DECODERS: dict[str, Callable[[bytes], None]] = {"protocol.decode": _protocol, "agent_channel": _agent_channel,
                                                "telemetry.DeltaDecoder": _telemetry, "control_socket.decode_line": _control_line,
                                                "wormhole.layout.unflatten": _skeleton}


def valid_inputs(name: str) -> list[bytes]:
    """The valid inputs to corrupt for decoder ``name``."""
    return [SKELETON] if name == "wormhole.layout.unflatten" else [VALID[-1]] if name.startswith("control") else VALID
