"""Moving one rank's state to a joining rank: the hand-over record (the user's save() state plus
TorchPass's own: the step and the DDP bucket layouts), sent by the donor to a file or through the
wormhole, and received on the joiner. Where the state goes is launchpad's choice (``dest``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from torchpass_common.errors import WorkerError

FORMAT = 1
_POLL = 0.005


def record(user_state: Any, step: int, ddp: list[dict[str, Any]]) -> dict[str, Any]:
    """The hand-over record for ``user_state`` taken after ``step`` completed steps."""
    return {"torchpass": {"format": FORMAT, "step": step, "ddp": ddp}, "user": user_state}


def send(rec: dict[str, Any], dest: dict[str, Any], *, rank: int) -> int:
    """Deliver ``rec`` to ``dest`` ({"path"} or {"host", "port", "token"}); returns bytes moved."""
    if "path" in dest:
        path = Path(dest["path"])
        tmp = path.with_name(path.name + ".part")
        torch.save(rec, tmp)
        os.replace(tmp, path)  # the joiner never sees a partial file
        return path.stat().st_size
    if {"host", "port", "token"} <= dest.keys():
        from launchpad.wormhole import send_state  # launchpad ships with torchpass; imported on use

        stats = send_state(rec, dest["host"], int(dest["port"]), bytes.fromhex(dest["token"]),
                           context={"rank": rank})
        return stats.bytes
    raise WorkerError(f"save destination has neither 'path' nor host/port/token: {sorted(dest)}",
                      hint="launchpad and torchpass disagree on the agent channel", rank=rank)


class Incoming:
    """The joiner's end of a hand-over, described by ``source`` (TORCHPASS_JOIN_SOURCE): from
    construction on it can take the state (a wormhole receiver is listening). ``template``: a
    record whose tensors the wormhole fills, e.g. the joiner's own parameters."""

    def __init__(self, source: dict[str, Any], *, rank: int, template: Any = None) -> None:
        self.rank = rank
        self._path: Path | None = None
        self._receiver: Any = None
        if "path" in source:
            self._path = Path(source["path"])
        elif {"listen_host", "port", "token"} <= source.keys():
            from launchpad.wormhole import StateReceiver

            self._receiver = StateReceiver(source["listen_host"], int(source["port"]),
                                           bytes.fromhex(source["token"]), template=template,
                                           context={"rank": rank})
        else:
            raise WorkerError(f"join source has neither 'path' nor listen_host/port/token: {sorted(source)}",
                              hint="check TORCHPASS_JOIN_SOURCE", rank=rank)

    def receive(self, timeout: float) -> dict[str, Any]:
        """Wait up to ``timeout`` s for the donor's record."""
        if self._receiver is not None:
            with self._receiver:
                rec = self._receiver.receive(timeout)
        else:
            rec = _wait_for_file(self._path, timeout, self.rank)
        meta = rec.get("torchpass") if isinstance(rec, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise WorkerError("the received state is not a TorchPass hand-over record of format "
                              f"{FORMAT}", hint="donor and joiner must run the same TorchPass", rank=self.rank)
        return rec


def _wait_for_file(path: Path | None, timeout: float, rank: int) -> Any:
    if path is None:
        raise WorkerError("no hand-over source to wait for", rank=rank)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise WorkerError(f"no hand-over state appeared at {path} within {timeout:.0f} s",
                              hint="did the leaving rank get its save command?", rank=rank)
        time.sleep(_POLL)
    # weights_only=False: the record holds the user's RNG states (numpy, random), and the file
    # comes from this job's own rank through launchpad, not from an outside source.
    return torch.load(path, weights_only=False)
