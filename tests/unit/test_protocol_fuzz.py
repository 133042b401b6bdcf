"""Fuzzing every decoder that reads bytes from outside the process (tests/support/decoders.py) with
hypothesis: whatever arrives (random bytes, random msgpack or JSON documents and envelopes, valid
inputs with bytes overwritten), each decodes it or refuses it with the project's error, never
anything else, and never slowly. CI runs a short run (``TORCHPASS_FUZZ_EXAMPLES``, default 500
per decoder and shape); ``pytest -m fuzz`` (``make test-matrix``) runs 100,000 per decoder."""

from __future__ import annotations

import json
import os
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.decoders import DECODERS, REFUSALS, valid_inputs

pytestmark = pytest.mark.security

HANG_S = 1.0
SHORT = int(os.environ.get("TORCHPASS_FUZZ_EXAMPLES", "500"))
LONG = 100_000
KEYS = ["v", "kind", "job", "gen", "id", "ts", "body", "t", "s", "b", "g", "n", "node", "seq", "workers", "cmd",
        "args", "migration", "op", "rank", "step", "state", "x"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats() | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=10) | st.sampled_from(KEYS), inner, max_size=4), max_leaves=10)
shallow = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.sampled_from(KEYS), scalars, max_size=3)
envelopes = st.dictionaries(st.sampled_from(KEYS), shallow, max_size=8)  # right keys, wrong values


@st.composite
def hostile(draw: st.DrawFn, name: str) -> bytes:
    """One hostile input for decoder ``name``: JSON documents for the control socket, msgpack for the rest."""
    pack = (lambda doc: json.dumps(doc, default=repr).encode()) if name.startswith("control") \
        else (lambda doc: msgpack.packb(doc, use_bin_type=True))
    shape = draw(st.sampled_from(["bytes", "document", "envelope", "corrupted"]))
    if shape == "bytes":
        return draw(st.binary(max_size=2048))
    if shape in ("document", "envelope"):
        doc = draw(values if shape == "document" else envelopes)
        try:
            return pack(doc)
        except (TypeError, ValueError, OverflowError):  # JSON cannot say NaN keys or bytes: send the bytes
            return msgpack.packb(doc, use_bin_type=True)
    base = draw(st.sampled_from(valid_inputs(name)))
    at = draw(st.integers(min_value=0, max_value=len(base) - 1))
    garbage = draw(st.binary(min_size=1, max_size=8))
    return base[:at] + garbage + base[at + len(garbage):]


def decodes_or_refuses(name: str, data: bytes) -> None:
    start = time.perf_counter()
    try:
        DECODERS[name](data)
    except REFUSALS:
        pass
    except Exception as exc:  # the finding: anything else would crash the reading loop
        raise AssertionError(f"{name} raised {type(exc).__name__}: {exc} on {data[:200]!r}") from exc
    took = time.perf_counter() - start
    assert took < HANG_S, f"{name} took {took:.2f} s on one input (a hang): {data[:200]!r}"


def _fuzz(name: str, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile(name))
    def run(data: bytes) -> None:
        decodes_or_refuses(name, data)
    run()


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_hostile_input_is_decoded_or_refused(name: str) -> None:
    _fuzz(name, SHORT)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_100k_hypothesis_inputs_per_decoder(name: str) -> None:
    _fuzz(name, LONG)
