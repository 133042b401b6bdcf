"""The wormhole's pickled values (what msgpack cannot express) against hostile skeletons and for
the values users' save() returns next to tensors: a payload naming os.system, builtins.open or
any global outside the allow-list is refused with WormholeError and runs nothing (also through a
real receiver, and already at the sender); RNG states of random / numpy / torch, numpy arrays,
dtypes and scalars, sets, deques and huge ints round-trip bit for bit."""

from __future__ import annotations

import pickle
import random
import re
import secrets
import time
from collections import OrderedDict, defaultdict, deque
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from launchpad.wormhole import StateReceiver, send_state
from launchpad.wormhole import layout as wl
from launchpad.wormhole import sender as ws
from launchpad.wormhole.safe_pickle import safe_loads
from torchpass_common.errors import WormholeError

TOKEN = secrets.token_bytes(32)


def transfer(state):
    with StateReceiver("127.0.0.1", 0, TOKEN) as rx:
        pending = rx.start(timeout=30)
        send_state(state, "127.0.0.1", rx.port, TOKEN)
        return pending.result(timeout=30)


def skeleton_with(payload: bytes) -> bytes:
    """A skeleton {"w": leaf 0, "evil": <pickled payload>} as a hostile (authenticated) peer would send."""
    return msgpack.packb({"w": msgpack.ExtType(wl._EXT_LEAF, (0).to_bytes(4, "big")),
                          "evil": msgpack.ExtType(wl._EXT_PICKLE, payload)}, use_bin_type=True)


def open_payload(path: Path) -> bytes:
    """Protocol 0: builtins.open(path, "w") on load (creates the file)."""
    return f"cbuiltins\nopen\n(V{path}\nVw\ntR.".encode()


def system_payload(path: Path) -> bytes:
    """Protocol 0: os.system("touch path") on load."""
    return f"cos\nsystem\n(Vtouch {path}\ntR.".encode()


class Touch:
    """Pickles (protocol 5, STACK_GLOBAL) as posix.system("touch path")."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


class Custom:
    """A user's own class, harmless in itself: refused all the same (its module is not trusted)."""

    def __init__(self) -> None:
        self.x = 1


def eval_payload(path: Path) -> bytes:
    """Protocol 4 (STACK_GLOBAL): builtins.eval("open(path, 'w')") on load."""
    code = f"open({str(path)!r}, 'w')".encode()
    return b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93\x8c" + bytes([len(code)]) + code + b"\x85R."


PAYLOADS = {"builtins.open": open_payload, "os.system": system_payload, "builtins.eval": eval_payload,
            "posix.system": lambda p: pickle.dumps(Touch(p), protocol=5)}


def test_the_payloads_are_live(tmp_path: Path):
    """Control: the payloads really run code under a plain unpickler (so a refusal below means something)."""
    for i, make in enumerate((open_payload, eval_payload)):
        marker = tmp_path / f"control{i}"
        pickle.loads(make(marker))  # noqa: S301 - the point of this control
        assert marker.exists()


@pytest.mark.security
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_a_skeleton_carrying_code_is_refused_and_runs_nothing(name, tmp_path: Path):
    marker = tmp_path / "pwned"
    with pytest.raises(WormholeError, match=rf"refused to unpickle {name}\b") as err:
        wl.unflatten(skeleton_with(PAYLOADS[name](marker)), [torch.zeros(1)])
    assert f"save() returned a {name}" in str(err.value)  # the hint names it too
    assert not marker.exists()


@pytest.mark.security
def test_a_receiver_refuses_a_hostile_skeleton_before_any_data_and_runs_nothing(tmp_path: Path, monkeypatch):
    """An authenticated peer (it holds the token) sends a manifest whose skeleton carries
    os.system: the receiver fails with the refused global named, nothing runs, nothing is loaded."""
    marker = tmp_path / "pwned"
    real = wl.flatten

    def hostile_flatten(state):
        _, leaves = real(state)
        return skeleton_with(system_payload(marker)), leaves

    monkeypatch.setattr(ws, "flatten", hostile_flatten)
    template = {"w": torch.full((64,), 7.0)}
    with StateReceiver("127.0.0.1", 0, TOKEN, template=template) as rx:
        pending = rx.start(timeout=30)
        with pytest.raises(WormholeError, match="refused to unpickle os.system"):
            send_state({"w": torch.ones(64)}, "127.0.0.1", rx.port, TOKEN)
        with pytest.raises(WormholeError, match=r"receiving state failed: refused to unpickle os\.system.*"
                                                r"save\(\) returned a os\.system"):
            pending.result(timeout=30)
    assert not marker.exists()
    assert torch.equal(template["w"], torch.full((64,), 7.0))


@pytest.mark.security
@pytest.mark.parametrize("value,name", [
    (Touch(Path("/nonexistent/x")), "posix.system"),
    (Custom(), f"{Custom.__module__}.Custom"),
    (OrderedDict(a=Custom()), f"{Custom.__module__}.Custom"),
    ({1, 2, eval}, "builtins.eval"),
    (np.array([1, Custom()], dtype=object), f"{Custom.__module__}.Custom"),
    (torch.Size([2, 3]), "torch.Size"),
], ids=["reduce-to-system", "user-class", "in-odict", "in-set", "in-object-array", "torch.Size"])
def test_the_sender_refuses_a_state_the_receiver_would_refuse(value, name):
    """Checked with the receiver's allow-list before anything is sent: the user learns it at once,
    with where in the state it sits."""
    escaped = re.escape(name)
    with pytest.raises(WormholeError, match=rf"state value at \['x'\]\[1\].* it pickles as {escaped}, which "
                                            rf"receivers refuse.*save\(\) returned a {escaped}"):
        wl.flatten({"x": [torch.ones(1), value]})


def test_malformed_pickles_are_a_wormhole_error():
    for junk in (b"", b"\x80\x05", b"garbage", b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7f."):
        with pytest.raises(WormholeError, match="malformed"):
            wl.unflatten(skeleton_with(junk), [torch.zeros(1)])


def test_rng_states_round_trip_bit_identically():
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    gen = np.random.default_rng(14)
    gen.random(3)  # mid-stream, with a buffered half word
    gen.integers(0, 2 ** 32, dtype=np.uint32)
    w = torch.randn(4)
    state = {"w": w, "random": random.getstate(), "numpy": np.random.get_state(),
             "numpy_dict": np.random.get_state(legacy=False), "generator": gen.bit_generator.state,
             "torch": torch.get_rng_state()}
    expected = (random.random(), np.random.random(4).tobytes(), gen.random(4).tobytes(), torch.rand(4))
    got = transfer(state)

    assert got["random"] == state["random"]
    random.setstate(got["random"])
    np.random.set_state(got["numpy"])
    again = np.random.default_rng()
    again.bit_generator.state = got["generator"]
    torch.set_rng_state(got["torch"])
    assert (random.random(), np.random.random(4).tobytes(), again.random(4).tobytes()) == expected[:3]
    assert torch.equal(torch.rand(4), expected[3])
    assert got["numpy_dict"]["state"]["key"].tobytes() == state["numpy_dict"]["state"]["key"].tobytes()
    assert got["numpy"][0] == "MT19937" and got["numpy"][1].tobytes() == state["numpy"][1].tobytes()
    assert got["generator"]["state"] == state["generator"]["state"]  # 128-bit ints, exactly


def test_numpy_values_and_other_plain_values_round_trip_bit_identically():
    g = np.random.default_rng(3)
    arrays = {
        "f32": g.standard_normal((5, 7)).astype(np.float32),
        "f64_T": g.standard_normal((4, 6)).T,  # Fortran order
        "strided": np.arange(100, dtype=np.int64)[::3],
        "u8": g.integers(0, 256, 33, dtype=np.uint8),
        "f16": g.standard_normal(9).astype(np.float16),
        "bool": g.integers(0, 2, 10).astype(bool),
        "c128": g.standard_normal(4) + 1j * g.standard_normal(4),
        "nan": np.array([np.nan, -np.inf, 0.0, -0.0]).view(np.uint64).__or__(np.uint64(1)).view(np.float64),
        "str": np.array(["a", "bcd"]),
        "record": np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
        "empty": np.empty((0, 3), dtype=np.float32),
        "zero_d": np.array(7, dtype=np.int16),
        "objects": np.array([1, "two", None, (3, 4)], dtype=object),
    }
    plain = {"np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64(np.nan)],
             "dtype": np.dtype("f8"), "struct_dtype": np.dtype([("a", "<i4"), ("b", ">f8")]),
             "set": {1, "a", (2, 3)}, "frozenset": frozenset({4, 5}), "complex": 1.5 - 2j,
             "slice": slice(1, None, 2), "range": range(3, 30, 4), "huge": [2 ** 200, -(2 ** 100), 1 << 64],
             "deque": deque([1, 2, 3], maxlen=5), "defaultdict": defaultdict(list, {"k": [1]}),
             "odict": OrderedDict(z=1, a=2)}
    got = transfer({"arrays": arrays, "plain": plain, "t": torch.ones(3)})
    for key, sent in arrays.items():
        back = got["arrays"][key]
        assert type(back) is np.ndarray and back.dtype == sent.dtype and back.shape == sent.shape, key
        if sent.dtype != object:
            assert back.tobytes(order="A") == sent.tobytes(order="A"), key
            assert back.flags.f_contiguous == sent.flags.f_contiguous or sent.ndim < 2, key
    assert list(got["arrays"]["objects"]) == [1, "two", None, (3, 4)]
    p = got["plain"]
    assert [type(v) for v in p["np_scalars"]] == [type(v) for v in plain["np_scalars"]]
    assert [v.tobytes() for v in p["np_scalars"]] == [v.tobytes() for v in plain["np_scalars"]]
    for key in ("dtype", "struct_dtype", "set", "frozenset", "complex", "slice", "range", "huge"):
        assert p[key] == plain[key] and type(p[key]) is type(plain[key]), key
    assert type(p["deque"]) is deque and list(p["deque"]) == [1, 2, 3] and p["deque"].maxlen == 5
    assert type(p["defaultdict"]) is defaultdict and p["defaultdict"]["new"] == [] and p["defaultdict"]["k"] == [1]
    assert type(p["odict"]) is OrderedDict and list(p["odict"]) == ["z", "a"]


def respell(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` (an unframed pickle) with each short string starting with ``old`` starting with ``new``."""
    out, last = bytearray(), 0
    for m in re.finditer(rb"\x8c([\x00-\xff])" + re.escape(old), data, re.DOTALL):
        n = m.group(1)[0]
        out += data[last:m.start()] + b"\x8c" + bytes([n - len(old) + len(new)]) + new + data[m.end():m.start() + 2 + n]
        last = m.start() + 2 + n
    return bytes(out + data[last:])


def test_a_numpy_1_senders_arrays_load_under_either_numpy():
    """numpy 1 pickles name numpy.core.*; numpy 2 ones numpy._core.*: both admitted, either way round."""
    values = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, "a"], dtype=object), np.float64(2.5)]
    for sent in values:
        current = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
        assert current[2] == 0x95  # one FRAME (optional to an unpickler): drop it, lengths change below
        current = current[:2] + current[11:]
        other = (respell(current, b"numpy._core.", b"numpy.core.") if b"numpy._core." in current
                 else respell(current, b"numpy.core.", b"numpy._core."))
        assert other != current
        for data in (current, other):
            back = safe_loads(data)
            assert type(back) is type(sent) and back.dtype == sent.dtype
            assert back.tobytes() == sent.tobytes() if sent.dtype != object else list(back) == list(sent)


def _proto4(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _global(module: str, name: str) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


BOMBS = {
    # list(range(10**10)): allowed types, unbounded work.
    "list-of-range": _proto4(_global("builtins", "list"), _global("builtins", "range"),
                             b"\x8a\x05\x00\xe4\x0bT\x02\x85R\x85R"),
    # numpy's _reconstruct asked for an object array of 10**9 slots (8 GB of None pointers).
    "reconstruct": _proto4(_global("numpy._core.multiarray", "_reconstruct"), _global("numpy", "ndarray"),
                           b"J\x00\xca\x9a;\x85C\x01O\x87R"),
    "deque-of-range": _proto4(_global("collections", "deque"), _global("builtins", "range"),
                              b"\x8a\x05\x00\xe4\x0bT\x02\x85R\x85R"),
}


@pytest.mark.security
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_pickle_that_would_cost_unbounded_memory_or_time_is_refused_at_once(name):
    started = time.perf_counter()
    with pytest.raises(WormholeError):
        wl.unflatten(skeleton_with(BOMBS[name]), [torch.zeros(1)])
    assert time.perf_counter() - started < 1.0


def test_a_huge_memo_index_costs_nothing():
    """A memo slot numbered 2**31 - 1: the C unpickler would allocate and zero a memo that large
    (seconds and gigabytes, found by the decoder fuzz); this one keeps its memo in a dict."""
    started = time.perf_counter()
    state = wl.unflatten(skeleton_with(_proto4(b"N", b"r\xff\xff\xff\x7f")), [torch.zeros(1)])
    assert state["evil"] is None and time.perf_counter() - started < 1.0


def test_a_declared_length_beyond_the_pickle_allocates_nothing():
    """BYTEARRAY8 declaring 2 GB in a pickle of a few bytes (found by the decoder fuzz)."""
    started = time.perf_counter()
    with pytest.raises(WormholeError, match="malformed"):
        wl.unflatten(skeleton_with(_proto4(b"\x96" + (2**31).to_bytes(8, "little") + b"xx")), [torch.zeros(1)])
    assert time.perf_counter() - started < 1.0
