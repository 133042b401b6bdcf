"""Wormhole round trips over loopback between a real sender and receiver: every dtype bit for bit
(NaN payloads included), strides, empty and 0-d tensors, nested plain values, templates (staged
and in place), files, byte buffers, progress, and the chunk striping plan."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launchpad.wormhole import File, StateReceiver, send_state
from launchpad.wormhole.plan import stripe

TOKEN = secrets.token_bytes(32)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]


def bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor's values, in logical order (NaN payloads compare too)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def transfer(state, *, streams: int = 2, chunk_bytes: int = 1 << 16, progress=None, **rx_kwargs):
    with StateReceiver("127.0.0.1", 0, TOKEN, streams=streams, **rx_kwargs) as rx:
        pending = rx.start(timeout=30)
        stats = send_state(state, "127.0.0.1", rx.port, TOKEN, streams=streams, chunk_bytes=chunk_bytes,
                           progress=progress)
        return pending.result(timeout=30), stats


@pytest.mark.parametrize("into", ["fresh", "staged", "in_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_arrives_bit_for_bit(dtype, into):
    # Random bytes reinterpreted as the dtype: floats include NaNs with arbitrary payloads, bools
    # include bytes other than 0/1; all must arrive as the same bits, with or without a template.
    state = {"big": random_tensor(dtype, (257, 129), 1), "scalar": random_tensor(dtype, (), 2),
             "empty": torch.empty(0, 5, dtype=dtype)}
    template = None if into == "fresh" else {k: torch.zeros_like(v) for k, v in state.items()}
    got, stats = transfer(state, template=template, in_place=into == "in_place")
    for key, sent in state.items():
        assert got[key].dtype == dtype and got[key].shape == sent.shape
        assert bits(got[key]) == bits(sent), key
    assert stats.bytes == (257 * 129 + 1) * dtype.itemsize


def test_nan_payloads_survive():
    payloads = torch.tensor([0x7FC00001, 0x7F800001, -0x00400001, 0x7FFFFFFF], dtype=torch.int32)
    got, _ = transfer({"nan": payloads.view(torch.float32)})
    assert torch.equal(got["nan"].view(torch.int32), payloads)


def test_strided_tensors_keep_values_and_dense_layouts():
    base = torch.arange(6 * 8 * 10, dtype=torch.float32).reshape(6, 8, 10)
    state = {"transposed": base.transpose(0, 2), "permuted": base.permute(1, 2, 0),
             "gappy": base[::2, 1:, ::3], "expanded": torch.arange(4.0).expand(3, 4),
             "offset_view": base.view(-1)[7:100]}
    got, _ = transfer(state)
    for key, sent in state.items():
        assert torch.equal(got[key], sent), key
    # Dense layouts travel as they lie in memory, so the receiver gets the same strides.
    assert got["transposed"].stride() == state["transposed"].stride()
    assert got["permuted"].stride() == state["permuted"].stride()
    assert got["gappy"].is_contiguous()


def test_nested_plain_values_and_containers_round_trip():
    state = OrderedDict(
        model=OrderedDict([("w", torch.randn(3, 4)), ("b", torch.randn(4))]),
        optim={"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 4)}},
               "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "nesterov": False}]},
        step=41, name="rank-3 ünïcode", blob=b"\x00\xffraw", none=None, nan=float("nan"),
        nested=[1, [2.5, (3, "x", [torch.ones(2, dtype=torch.int64)])], {"k": ()}],
        rng=torch.get_rng_state(), big_int=2 ** 70, tuple_key={(1, "a"): "v"},
    )
    got, _ = transfer(state)
    assert type(got) is OrderedDict and type(got["model"]) is OrderedDict
    assert list(got) == list(state) and list(got["model"]) == ["w", "b"]
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert got["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert isinstance(got["optim"]["param_groups"][0]["betas"], tuple)
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert (got["step"], got["name"], got["blob"], got["none"]) == (41, "rank-3 ünïcode", b"\x00\xffraw", None)
    assert got["nan"] != got["nan"]
    assert got["nested"][1][1][:2] == (3, "x") and torch.equal(got["nested"][1][1][2][0], torch.ones(2).long())
    assert got["nested"][2] == {"k": ()}
    assert torch.equal(got["rng"], state["rng"])
    assert got["big_int"] == 2 ** 70 and got["tuple_key"] == {(1, "a"): "v"}


def test_parameters_requiring_grad_are_sent_as_values():
    model = torch.nn.Linear(16, 8)
    got, _ = transfer(model.state_dict(keep_vars=True))
    assert torch.equal(got["weight"], model.weight.detach()) and not got["weight"].requires_grad


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in_place"])
def test_template_receives_into_the_joiners_own_tensors(in_place):
    sender = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    joiner = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    template = {"model": joiner.state_dict(), "step": 0}
    weight = joiner[0].weight
    got, _ = transfer({"model": sender.state_dict(), "step": 9}, template=template, in_place=in_place)
    assert got["step"] == 9
    assert got["model"]["0.weight"] is template["model"]["0.weight"]
    assert weight.data_ptr() == got["model"]["0.weight"].data_ptr()
    for name, t in sender.state_dict().items():
        assert torch.equal(joiner.state_dict()[name], t), name


def test_template_with_other_layout_is_filled_by_value():
    sent = torch.arange(12.0).reshape(3, 4)
    template = {"w": torch.zeros(4, 3).t()}  # same shape, column-major
    got, _ = transfer({"w": sent}, template=template, in_place=True)
    assert got["w"] is template["w"] and torch.equal(template["w"], sent)


def test_template_shape_mismatch_is_a_clear_error():
    with StateReceiver("127.0.0.1", 0, TOKEN, template={"w": torch.zeros(3, 3)}) as rx:
        pending = rx.start(timeout=30)
        with pytest.raises(Exception, match="rejected"):
            send_state({"w": torch.zeros(4, 3)}, "127.0.0.1", rx.port, TOKEN)
        with pytest.raises(Exception, match=r"\['w'\] is float32\[4, 3\] but the receive template has "
                                            r"float32\[3, 3\]"):
            pending.result(timeout=30)


def test_files_and_byte_buffers_arrive_by_content(tmp_path: Path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "pages-1.img").write_bytes(secrets.token_bytes(300_000))
    (src / "empty.img").write_bytes(b"")
    state = {"images": [File(src / "pages-1.img"), File(src / "empty.img", name="core-1.img")],
             "pipe": bytearray(secrets.token_bytes(70_000))}
    got, _ = transfer(state, files_dir=dst)
    assert got["images"] == [dst / "pages-1.img", dst / "core-1.img"]
    assert (dst / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    assert (dst / "core-1.img").read_bytes() == b""
    assert got["pipe"] == state["pipe"]
    assert sorted(p.name for p in dst.iterdir()) == ["core-1.img", "pages-1.img"]


def test_progress_reports_bytes_and_rate():
    seen = []
    state = {"w": torch.randn(1 << 20)}
    _, stats = transfer(state, progress=seen.append, chunk_bytes=1 << 16)
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total == 4 << 20 == stats.bytes
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:], strict=False))
    assert seen[-1].rate > 0 and stats.gbps > 0


@pytest.mark.parametrize("streams", [1, 3, 8])
def test_many_streams_and_tiny_chunks(streams):
    state = {f"t{i}": random_tensor(torch.float32, (i * 997 + 1,), i) for i in range(20)}
    got, stats = transfer(state, streams=streams, chunk_bytes=4096)
    assert all(bits(got[k]) == bits(v) for k, v in state.items()) and stats.streams == streams


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(1, 8), st.integers(1, 1500))
def test_stripe_covers_every_byte_once_and_balances(sizes, streams, chunk):
    plan = stripe(sizes, streams, chunk)
    covered = sorted((c.item, c.offset, c.length) for s in plan for c in s)
    expected = [(i, off, min(chunk, n - off)) for i, n in enumerate(sizes) for off in range(0, n, chunk)]
    assert covered == expected
    loads = [sum(c.length for c in s) for s in plan]
    assert max(loads) - min(loads) <= chunk
    for s in plan:  # each stream sends its chunks in leaf order, so a leaf's bytes arrive in order
        assert [(c.item, c.offset) for c in s] == sorted((c.item, c.offset) for c in s)
