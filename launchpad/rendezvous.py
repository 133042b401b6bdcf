"""Rendezvous without an orchestrator: one agent hosts a TCPStore at the rendezvous endpoint and
every agent agrees on membership through it (fixed node ranks, or ranks handed out in join order),
one round per restart. The same store serves the workers (TORCHELASTIC_USE_AGENT_STORE) and the
re-form prefixes; this module owns the store's key layout and the failure/done signals."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from launchpad.spec import LaunchSpec
from torchpass_common import log
from torchpass_common.errors import TorchPassError

if TYPE_CHECKING:
    import torch.distributed as dist

_POLL = 0.05


class RendezvousError(TorchPassError):
    """Agents could not agree on membership, or the rendezvous store went away."""


@dataclass(frozen=True)
class Membership:
    """This node's place in one round: which global ranks it runs and where the store is."""

    round: int
    node_rank: int
    nnodes: int
    rank_offset: int
    local_world_size: int
    world_size: int
    store_host: str
    store_port: int


def _is_local_address(host: str) -> bool:
    """True when ``host`` names an address of this machine (or network namespace)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def store_listening(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether the rendezvous store at ``host:port`` accepts connections (a hot spare's sign that
    the job still trains: the store's host closes it once every node is done)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def joiner_membership(spec: LaunchSpec) -> Membership:
    """The place of a launchpad that joins a running job (a spare, started by torchpassd): fixed by
    its join plan, not agreed in a round. One node of its own (the plan gives its ranks, world size
    and node rank), the job's store at the rendezvous endpoint."""
    return Membership(round=0, node_rank=0, nnodes=1, rank_offset=0, local_world_size=spec.nproc_per_node,
                      world_size=spec.nproc_per_node, store_host=spec.rdzv_host, store_port=spec.rdzv_port)


class Rendezvous:
    """The agent's handle on the rendezvous store. ``hosting`` tells whether this agent runs the
    store server (and so must outlive the others' workers: see :meth:`finish`)."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self._log = log.get(job=spec.job, node=spec.node, run=spec.run_id)
        self._ns = f"/launchpad/{spec.run_id}"
        self.cancel = threading.Event()  # set from another thread to give up waiting for peers
        self.store, self.hosting = self._connect()
        self.host = spec.rdzv_host
        self.port = self.store.port

    def _connect(self) -> tuple[dist.TCPStore, bool]:
        import torch.distributed as dist  # here, not at import: seconds, which a joining launchpad skips

        spec = self.spec
        timeout = timedelta(seconds=spec.join_timeout)
        should_host = spec.node_rank == 0 if spec.node_rank is not None else _is_local_address(spec.rdzv_host)
        if should_host:
            try:
                store = dist.TCPStore(spec.rdzv_host, spec.rdzv_port, is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                self._log.info("rendezvous.hosting", host=spec.rdzv_host, port=store.port)
                return store, True
            except (RuntimeError, dist.DistNetworkError) as exc:
                if spec.node_rank == 0:
                    raise RendezvousError(
                        f"cannot host the rendezvous store on port {spec.rdzv_port}: {exc}",
                        hint="the port is taken; pass a free --master-port / --rdzv-endpoint") from exc
                # another agent on this host got there first: join as a client
        try:
            store = dist.TCPStore(spec.rdzv_host, spec.rdzv_port, is_master=False, timeout=timeout)
        except (RuntimeError, dist.DistNetworkError) as exc:
            raise RendezvousError(
                f"cannot reach the rendezvous store at {spec.rdzv_host}:{spec.rdzv_port} "
                f"within {spec.join_timeout:.0f} s: {exc}",
                hint="check that node rank 0's launchpad runs and the endpoint is reachable") from exc
        return store, False

    def close(self) -> None:
        """Drop the store (stopping its server if hosted) now: left to the garbage collector at
        interpreter exit, the hosted server's destructor can hang."""
        del self.store

    def _key(self, rnd: int, name: str) -> str:
        return f"{self._ns}/r{rnd}/{name}"

    def join(self, rnd: int) -> Membership:
        """Join round ``rnd`` and block until membership is closed; raises RendezvousError when the
        round does not close within the join timeout or this node came too late."""
        spec = self.spec
        if spec.node_rank is not None:
            node_rank = spec.node_rank
        else:
            node_rank = self.store.add(self._key(rnd, "next_rank"), 1) - 1
        self.store.set(self._key(rnd, f"node/{node_rank}"), json.dumps({"nproc": spec.nproc_per_node}))
        self.store.add(self._key(rnd, "joined"), 1)
        if node_rank == 0:
            self._close(rnd)
        nnodes = int(self._wait(self._key(rnd, "closed"), spec.join_timeout))
        if node_rank >= nnodes:
            raise RendezvousError(f"node joined round {rnd} after membership closed at {nnodes} nodes",
                                  hint="raise --nnodes MAX or start all nodes together", node_rank=node_rank)
        nprocs = [json.loads(self.store.get(self._key(rnd, f"node/{i}")))["nproc"] for i in range(nnodes)]
        m = Membership(round=rnd, node_rank=node_rank, nnodes=nnodes, rank_offset=sum(nprocs[:node_rank]),
                       local_world_size=spec.nproc_per_node, world_size=sum(nprocs),
                       store_host=self.host, store_port=self.port)
        self._log.info("rendezvous.joined", round=rnd, node_rank=node_rank, nnodes=nnodes, world_size=m.world_size)
        return m

    def _close(self, rnd: int) -> None:
        """Node 0 closes the round: at MAX nodes, or at MIN nodes plus the last-call window."""
        spec = self.spec
        deadline = time.monotonic() + spec.join_timeout
        min_reached_at: float | None = None
        while True:
            joined = self.store.add(self._key(rnd, "joined"), 0)
            now = time.monotonic()
            if joined >= spec.nnodes_min and min_reached_at is None:
                min_reached_at = now
            if joined >= spec.nnodes_max or (min_reached_at is not None and now - min_reached_at >= spec.last_call):
                self.store.set(self._key(rnd, "closed"), str(min(joined, spec.nnodes_max)))
                return
            if now > deadline:
                raise RendezvousError(
                    f"only {joined} of {spec.nnodes_min} nodes joined round {rnd} within {spec.join_timeout:.0f} s",
                    hint="start launchpad on every node with the same --rdzv-endpoint and --rdzv-id")
            self._pause(rnd)

    def _wait(self, key: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RendezvousError(f"rendezvous key {key} did not appear within {timeout:.0f} s",
                                      hint="node rank 0's launchpad may have died; check its log")
            self._pause(None)
        return self.store.get(key).decode()

    def _pause(self, rnd: int | None) -> None:
        if self.cancel.wait(_POLL):
            raise RendezvousError("rendezvous cancelled (launchpad is stopping)", round=rnd)

    def report_failure(self, rnd: int, what: str) -> None:
        """Tell every agent that round ``rnd`` failed (first writer wins)."""
        self.store.compare_set(self._key(rnd, "failed"), "", what)

    def failure(self, rnd: int) -> str | None:
        """The failure another agent reported for round ``rnd``, if any (non-blocking)."""
        key = self._key(rnd, "failed")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def finish(self, rnd: int, nnodes: int, timeout: float | None) -> None:
        """Report this node done; the hosting agent waits until ``nnodes`` are (at most ``timeout``
        seconds; None: until then, another node's failure report or a stop), so the store outlives
        the other nodes' workers."""
        self.store.add(self._key(rnd, "done"), 1)
        if not self.hosting:
            return
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self.store.add(self._key(rnd, "done"), 0) < nnodes and self.failure(rnd) is None:
            if time.monotonic() > deadline:
                self._log.warning("rendezvous.finish_timeout", round=rnd, waited=timeout)
                return
            if self.cancel.wait(_POLL):
                return
