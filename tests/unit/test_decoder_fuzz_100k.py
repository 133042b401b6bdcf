"""100,000 malformed inputs per decoder that reads bytes from outside the process (issue 11):
the MQTT message decoder (torchpassd and launchpad), launchpad's worker-channel frames, the GPU
telemetry deltas torchpassd decodes from heartbeats, torchpassd's control-socket lines, and the
wormhole's state skeleton (msgpack with allow-listed pickles; issue 21).
Each input either decodes or is refused with the project's error: no other exception, no call
slower than HANG_S. Seeded, so a failure is reproducible; TORCHPASS_FUZZ_100K sets the count."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import structlog

from tests.support.decoders import DECODERS, REFUSALS, VALID, valid_inputs
from torchpass_common import log, mqtt, protocol
from torchpass_common.config import BrokerConfig

pytestmark = [pytest.mark.security]
COUNT = int(os.environ.get("TORCHPASS_FUZZ_100K", "100000"))
HANG_S = 1.0
KEYS = ["v", "kind", "job", "gen", "id", "ts", "body", "t", "s", "b", "g", "x", "n", "node", "seq", "workers",
        "cmd", "args", "migration", "op", "rank", "step", "state"]
def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.45:
        return rng.choice([None, True, False, rng.randint(-2**63, 2**64 - 1), rng.randint(-5, 5), rng.random() * 1e9,
                           float("nan"), "", "x" * rng.randint(0, 300), rng.choice(KEYS), os.urandom(rng.randint(0, 20))])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {(rng.choice(KEYS) if rng.random() < 0.8 else _value(rng, 4)): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 6))}


def inputs(seed: int, n: int, *, as_json: bool = False, valid: list[bytes] = VALID) -> Iterator[bytes]:
    """``n`` hostile byte strings: random bytes, random msgpack (or JSON) documents and envelopes,
    and ``valid`` messages with bytes flipped, cut or spliced."""
    rng = random.Random(seed)
    pack = ((lambda doc: json.dumps(doc, default=repr, skipkeys=True).encode()) if as_json
            else (lambda doc: msgpack.packb(doc, use_bin_type=True)))
    for i in range(n):
        kind = i % 4
        if kind == 0:
            yield rng.randbytes(rng.randint(0, 512))
        elif kind == 1:
            yield pack(_value(rng) if not as_json or rng.random() < 0.5 else [_value(rng)])
        elif kind == 2:
            doc = {k: _value(rng, 2) for k in rng.sample(KEYS, rng.randint(1, 8))}
            yield pack(doc)
        else:
            base = bytearray(VALID[-1] if as_json else rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                op, at = rng.random(), rng.randrange(len(base))
                if op < 0.5:
                    base[at] = rng.randrange(256)
                elif op < 0.75:
                    del base[at:]
                    base += rng.randbytes(rng.randint(0, 8))
                else:
                    base[at:at] = rng.randbytes(rng.randint(1, 8))
                if not base:
                    break
            yield bytes(base)





@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_100k_hostile_inputs_per_decoder(name: str) -> None:
    decode = DECODERS[name]
    accepted = refused = 0
    slowest, t0 = 0.0, time.perf_counter()
    valid = valid_inputs(name)
    for i, data in enumerate(inputs(seed=sum(name.encode()), n=COUNT, as_json=name.startswith("control"), valid=valid)):
        start = time.perf_counter()
        try:
            decode(data)
            accepted += 1
        except REFUSALS:
            refused += 1
        except Exception as exc:  # the finding: anything else would crash the reading loop
            raise AssertionError(f"{name} raised {type(exc).__name__}: {exc} on input #{i}: {data[:200]!r}") from exc
        slowest = max(slowest, time.perf_counter() - start)
    took = time.perf_counter() - t0
    print(f"{name}: {COUNT} inputs in {took:.1f} s, {refused} refused, {accepted} accepted, slowest {slowest*1e3:.1f} ms")
    # Any msgpack document is a well-formed skeleton: that decoder refuses only the broken ones.
    assert accepted + refused == COUNT and refused > COUNT // (4 if name == "wormhole.layout.unflatten" else 2)
    assert slowest < HANG_S, f"{name} took {slowest:.2f} s on one input (a hang)"


def test_control_client_logs_each_rejection() -> None:
    """Through the real consumer path: every refused payload is one ``mqtt.message_rejected`` log
    line, and a valid message queued after 2,000 hostile ones is still delivered."""
    client = mqtt.ControlClient(BrokerConfig(), "fuzz")
    topic = protocol.hb_topic("9", "n1")
    hostile = [d for d in inputs(seed=7, n=2000) if d != VALID[0]]
    for data in hostile:
        client._inbox.put_nowait((topic, data))
    client._inbox.put_nowait((topic, VALID[0]))

    async def first() -> tuple[str, protocol.Message]:
        async for item in client.messages():
            return item
        raise AssertionError("no message")

    log.get()  # configure logging now: a first log.get() inside capture_logs would undo the capture
    with structlog.testing.capture_logs() as logs:
        _topic, msg = asyncio.run(asyncio.wait_for(first(), 60))
    rejected = [e for e in logs if e["event"] == "mqtt.message_rejected"]
    assert msg.job == "9" and msg.body["seq"] == 3
    assert len(rejected) == len(hostile) and all(e["reason"] for e in rejected)
