"""The wormhole between two nodes of the real dev cluster: the sender runs inside n1, the
receiver inside n2 (separate network namespaces, addresses and ports), and a stranger in n3.
The state must arrive bit for bit; a peer without the token is refused and nothing loads."""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm]


def sample_state(seed: int) -> dict[str, Any]:
    """A save()-like state with every dtype the issue names, deterministic per seed."""
    g = torch.Generator().manual_seed(seed)

    def rnd(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)

    return {
        "model": OrderedDict([("embed", rnd(torch.float32, 1000, 256)), ("w_bf16", rnd(torch.bfloat16, 256, 512)),
                              ("mask", rnd(torch.bool, 64, 64)), ("ids", rnd(torch.int64, 4096)),
                              ("w_t", rnd(torch.float32, 300, 200).t()), ("empty", rnd(torch.float16, 0, 8)),
                              ("scale", rnd(torch.float64))]),
        "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": rnd(torch.float32, 512, 256)}},
                  "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0]}]},
        "step": 1000 + seed, "sampler": {"epoch": 2, "offset": seed * 7, "name": f"rank{seed}"},
        "nested": [1, [2.5, ("x", None)], []],
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def node_receive(workdir: str, token_hex: str, host: str) -> None:
    """Inside n2: receive into a template, compare with the sender's state, write the verdict."""
    from launchpad.wormhole import StateReceiver

    template = sample_state(0)
    with StateReceiver(host, 0, bytes.fromhex(token_hex), template=template) as rx:
        (Path(workdir) / "port").write_text(str(rx.port))
        got = rx.receive(timeout=60)
    expected = sample_state(1)
    bad = [k for k in expected["model"] if _bits(got["model"][k]) != _bits(expected["model"][k])
           or got["model"][k].stride() != expected["model"][k].stride()]
    same_plain = (got["step"], got["sampler"], got["nested"], got["optim"]["param_groups"]) == (
        expected["step"], expected["sampler"], expected["nested"], expected["optim"]["param_groups"])
    result = {"mismatched": bad, "plain_equal": same_plain, "refused": rx.refused,
              "into_template": got["model"]["embed"] is template["model"]["embed"],
              "exp_avg": _bits(got["optim"]["state"][0]["exp_avg"]) == _bits(expected["optim"]["state"][0]["exp_avg"])}
    (Path(workdir) / "result.json").write_text(json.dumps(result))


def node_send(workdir: str, token_hex: str, host: str) -> None:
    """Inside n1 (or n3 with a wrong token): wait for the receiver's port and send."""
    from launchpad.wormhole import send_state

    port_file = Path(workdir) / "port"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise SystemExit("receiver never published its port")
        time.sleep(0.05)
    stats = send_state(sample_state(1), host, int(port_file.read_text()), bytes.fromhex(token_hex),
                       streams=2, chunk_bytes=256 << 10)
    print(json.dumps({"bytes": stats.bytes, "gbps": stats.gbps}))


def _in_node(devcluster, node: str, func: str, *args: str, check: bool = True):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from tests.integration.test_wormhole_nodes import {func}; {func}(*sys.argv[1:])")
    return devcluster.exec(node, [sys.executable, "-c", code, *args], check=check, timeout=120)


def test_state_moves_between_nodes_bit_for_bit_and_strangers_are_refused(devcluster, tmp_path):
    devcluster.reset()
    addr = {n["name"]: n["addr"] for n in devcluster.info["nodes"]}
    token = secrets.token_hex(32)
    receiver = threading.Thread(target=_in_node, args=(devcluster, "n2", "node_receive", str(tmp_path),
                                                       token, addr["n2"]))
    receiver.start()
    stranger = _in_node(devcluster, "n3", "node_send", str(tmp_path), secrets.token_hex(32), addr["n2"],
                        check=False)
    sent = _in_node(devcluster, "n1", "node_send", str(tmp_path), token, addr["n2"])
    receiver.join(120)
    assert stranger.returncode != 0 and "receiver failed authentication" in stranger.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["mismatched"] == [] and result["plain_equal"] and result["exp_avg"]
    assert result["into_template"]
    assert len(result["refused"]) == 1 and "challenge" in result["refused"][0]
    assert json.loads(sent.stdout.strip().splitlines()[-1])["bytes"] > 1_500_000
