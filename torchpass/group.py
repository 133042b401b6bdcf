"""TorchPassGroup: the default process group a TorchPass worker runs on. It forwards every
collective to an inner c10d ProcessGroup on the real backend (gloo, nccl) and can rebuild that
inner group for a new generation (fresh store prefix) while DDP/FSDP keep holding this object.
In local mode (a joining rank not yet admitted) it answers the collectives DDP's constructor and
bucket rebuild issue without any peer. Installing it as the default group is bootstrap.py's job."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from torchpass import steps
from torchpass_common import log
from torchpass_common.errors import WorkerError

BACKEND_NAME = "torchpass"
MAX_WATCHED = 4096  # works kept per step for failed(); a step issuing more keeps its latest

# Every collective a c10d ProcessGroup exposes (Python API names, which are also the names the
# C++ trampoline calls for DDP's reducer); each is forwarded unchanged to the inner group.
FORWARDED = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce",
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
    "all_gather_single", "all_gather_single_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
    "gather", "scatter", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
)


def build_inner(backend: str, store: dist.Store, rank: int, world_size: int,
                timeout: timedelta, name: str) -> dist.ProcessGroup:
    """A plain c10d ProcessGroup on ``backend`` ("gloo", "nccl", "cpu:gloo,cuda:nccl"), built the
    way ``init_process_group`` builds one, but not registered as any torch global."""
    pg = dist.ProcessGroup(store, rank, world_size)
    device_map = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    made: dict[str, Any] = {}
    for device, name_ in device_map.items():
        if name_ not in made:
            made[name_] = _make_backend(name_, dist.PrefixStore(f"{name_}/", store), rank, world_size,
                                        timeout)
        kind = dist.Backend.backend_type_map[name_]
        pg._register_backend(torch.device(device), kind, made[name_])
    first = "nccl" if "nccl" in made else next(iter(made))
    pg._set_default_backend(dist.Backend.backend_type_map[first])
    pg._set_group_name(name)
    return pg


def _make_backend(name: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if name == "nccl":
        if not dist.is_nccl_available():
            raise WorkerError("init_process_group asked for nccl, but this torch build has no NCCL",
                              hint="install a CUDA build of torch or use gloo", rank=rank)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise WorkerError(f"TorchPass cannot wrap the {name!r} process group backend",
                      hint="use gloo or nccl in init_process_group", rank=rank)


def _done(result: Any) -> Any:
    """A completed Work, for collectives answered locally."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class TorchPassGroup(dist.ProcessGroup):
    """The reconfigurable default group. ``gen`` is the generation its inner group belongs to
    (0 while local). Only reconfigure between steps, when no collective is in flight."""

    def __init__(self, backend: str, store: dist.Store | None, rank: int, world_size: int,
                 timeout: timedelta, *, local: bool) -> None:
        super().__init__(rank, world_size)
        self.backend = backend
        self.timeout = timeout
        self.gen = 0
        self.failure: BaseException | None = None  # the failed collective failed() found, this generation
        self._watched: collections.deque[Any] = collections.deque(maxlen=MAX_WATCHED)
        self._watched_step = -1
        self._inner: dist.ProcessGroup | None = None
        self._replies: collections.deque[torch.Tensor] = collections.deque()
        if not local:
            if store is None:
                raise WorkerError("a non-local TorchPass group needs a store", rank=rank)
            self._inner = build_inner(backend, store, rank, world_size, timeout, "torchpass_gen1")
            self.gen = 1

    @property
    def local(self) -> bool:
        return self._inner is None

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND_NAME

    def reconfigure(self, gen: int, rank: int, world_size: int, store: dist.Store, prefix: str) -> None:
        """Build the inner group of generation ``gen`` on ``PrefixStore(prefix, store)``; blocks until
        every member of the new generation has joined (or the group's timeout). Rank and world
        size are fixed for the life of the process (c10d caches them in the outer group)."""
        if (rank, world_size) != (self.rank(), self.size()):
            raise WorkerError(
                f"re-form asks for rank {rank} of {world_size}, but this process is rank "
                f"{self.rank()} of {self.size()}; a TorchPass group keeps its rank and world size",
                hint="give the replacement process the leaving rank's number", rank=self.rank(), gen=gen)
        new = build_inner(self.backend, dist.PrefixStore(prefix, store), rank, world_size, self.timeout,
                          f"torchpass_gen{gen}")
        old, self._inner, self.gen = self._inner, new, gen
        self._forget_works()
        if old is not None:
            # Join the old backend's threads with the GIL released (shutdown() drops it) before the
            # last reference goes; a destructor that joins them under the GIL can deadlock.
            old.shutdown()
        log.get(rank=rank, gen=gen).info("group.reformed", prefix=prefix, backend=self.backend)

    def shutdown(self) -> None:
        """destroy_process_group() calls this: shut the current inner group down."""
        if self._inner is not None:
            self._inner.shutdown()

    def release(self) -> None:
        """Shut the inner group down and drop it, so its sockets close (shutdown() alone leaves
        gloo's listening socket open): what a worker does before criu moves it. Until the next
        reconfigure the group is local; call it only while parked."""
        inner, self._inner = self._inner, None
        self._forget_works()
        if inner is not None:
            inner.shutdown()

    def abort(self) -> None:
        if self._inner is not None:
            self._inner.abort()

    def abandon(self) -> None:
        """After a failed collective: abort and shut the inner group down (closing its connections,
        so peers still waiting on this rank fail at once instead of at their timeout) and drop it;
        the group is local until the next reconfigure."""
        inner, self._inner = self._inner, None
        self._watched.clear()  # the failure itself is kept: the interruption reports it
        if inner is not None:
            with contextlib.suppress(RuntimeError):
                inner.abort()
            inner.shutdown()

    def watch(self, work: Any) -> Any:
        """Return ``work``, kept (with the others of this step) so that failed() can find it if it
        completes with an error. No callback per collective: a Python done-callback costs each
        collective a hand-over of the GIL to the backend's thread (~60 us on the dev VM), paid on
        every DDP bucket of every step. The works of a step are dropped at the next step's first
        collective (their tensors are the step's own), or beyond MAX_WATCHED in one step."""
        step = steps.current()
        if step != self._watched_step:
            self._watched.clear()
            self._watched_step = step
        self._watched.append(work)
        return work

    def failed(self) -> BaseException | None:
        """The error of a collective of this generation that failed (a peer lost, or frozen past
        the timeout), if one did: how the bootstrap tells an interruption from a bug in the script."""
        if self.failure is None:
            for work in list(self._watched):
                try:
                    fut = work.get_future()
                except RuntimeError:  # some works (send/recv) have no future
                    continue
                if not fut.done():
                    continue
                try:
                    fut.value()
                except Exception as exc:  # the collective's error, kept for the interruption report
                    self.failure = exc
                    break
        return self.failure

    def _forget_works(self) -> None:
        """A new generation, or none: the works of the old one say nothing about it."""
        self._watched.clear()
        self.failure = None

    @contextmanager
    def answering_broadcasts(self, replies: Sequence[torch.Tensor]) -> Iterator[None]:
        """While local, answer the next broadcasts with ``replies`` (in order) instead of the
        local values: how a joining rank's DDP receives rank 0's bucket layout."""
        if not self.local:
            raise WorkerError("broadcast replies are only for a local (joining) group", rank=self.rank())
        self._replies.extend(replies)
        try:
            yield
        finally:
            left = len(self._replies)
            self._replies.clear()
        if left:
            raise WorkerError(f"{left} prepared broadcast replies were not consumed", rank=self.rank(),
                              hint="the joining rank's DDP issued fewer collectives than expected")

    def _local(self, name: str, args: tuple[Any, ...]) -> Any:
        handler = _LOCAL.get(name)
        if handler is None:
            raise WorkerError(
                f"collective {name} called on a joining rank before torchpass.register()",
                hint="a joining rank may only build its model, DDP/FSDP and optimizer before register(); "
                     "move other collectives after it", rank=self.rank())
        return handler(self, *args)

    def _local_broadcast(self, tensors: list[torch.Tensor], *_: Any) -> Any:
        if self._replies:
            reply = self._replies.popleft()
            if reply.numel() != tensors[0].numel():
                raise WorkerError(
                    f"prepared broadcast reply has {reply.numel()} elements, DDP expects "
                    f"{tensors[0].numel()}", hint="the donor and the joiner built different models",
                    rank=self.rank())
            tensors[0].copy_(reply.view_as(tensors[0]))
        return _done(tensors)

    def _local_allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                         *_: Any) -> Any:
        for outs, inp in zip(outputs, inputs, strict=True):
            for out in outs:
                out.copy_(inp)
        return _done(outputs)

    def _local_all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, *_: Any) -> Any:
        for chunk in output.view(self.size(), *inp.shape).unbind(0):
            chunk.copy_(inp)
        return _done([output])

    def _local_barrier(self, *_: Any) -> Any:
        return _done([])


_LOCAL = {
    "broadcast": TorchPassGroup._local_broadcast,
    "allgather": TorchPassGroup._local_allgather,
    "all_gather_single": TorchPassGroup._local_all_gather_single,
    "barrier": TorchPassGroup._local_barrier,
}


def _forwarder(name: str) -> Any:
    def forward(self: TorchPassGroup, *args: Any) -> Any:
        inner = self._inner
        if inner is None:
            return self._local(name, args)
        return self.watch(getattr(inner, name)(*args))

    forward.__name__ = name
    forward.__doc__ = f"Forward ``{name}`` to the current generation's inner group."
    return forward


for _name in FORWARDED:
    setattr(TorchPassGroup, _name, _forwarder(_name))
