"""TorchPassGroup: the default process group a TorchPass worker runs on. It forwards every
collective to an inner c10d ProcessGroup on the real backend (gloo, nccl) and can rebuild that
inner group for a new generation (fresh store prefix) while DDP/FSDP keep holding this object.
In local mode (a joining rank not yet admitted) it answers the collectives DDP's constructor and
bucket rebuild issue without any peer. Installing it as the default group is bootstrap.py's job."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from torchpass import severing, steps
from torchpass_common import log
from torchpass_common.errors import WorkerError

BACKEND_NAME = "torchpass"
REFORMABLE_BACKENDS = ("gloo", "nccl")  # what build_inner can build again at every re-form

# The backend a new_group call asked for: c10d hands the default group's new_group only ranks,
# timeout, options, name and description, so default_group's wrapper of c10d's new_group sets it.
requested_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("torchpass_new_group_backend",
                                                                             default=None)
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
                timeout: timedelta, name: str, options: Any = None) -> dist.ProcessGroup:
    """A plain c10d ProcessGroup on ``backend`` ("gloo", "nccl", "cpu:gloo,cuda:nccl"), built the
    way ``init_process_group`` builds one, but not registered as any torch global. ``options``:
    a backend's own options object (ProcessGroupNCCL.Options), used for that backend."""
    pg = dist.ProcessGroup(store, rank, world_size)
    device_map = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    made: dict[str, Any] = {}
    for device, name_ in device_map.items():
        if name_ not in made:
            made[name_] = _make_backend(name_, dist.PrefixStore(f"{name_}/", store), rank, world_size,
                                        timeout, options)
        kind = dist.Backend.backend_type_map[name_]
        pg._register_backend(torch.device(device), kind, made[name_])
    first = "nccl" if "nccl" in made else next(iter(made))
    pg._set_default_backend(dist.Backend.backend_type_map[first])
    pg._set_group_name(name)
    return pg


def _make_backend(name: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                  options: Any = None) -> Any:
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if name == "nccl":
        if not dist.is_nccl_available():
            raise WorkerError("init_process_group asked for nccl, but this torch build has no NCCL",
                              hint="install a CUDA build of torch or use gloo", rank=rank)
        nccl_options = getattr(dist.ProcessGroupNCCL, "Options", None)
        opts = options if nccl_options is not None and isinstance(options, nccl_options) else nccl_options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise WorkerError(f"TorchPass cannot wrap the {name!r} process group backend",
                      hint="use gloo or nccl in init_process_group", rank=rank)


def check_backend(backend: str, api: str, rank: int) -> str:
    """``backend`` ("gloo", "cpu:gloo,cuda:nccl"...) normalised, if every device's backend in it
    can be re-formed; else a WorkerError naming ``api``, at the call (not at the next re-form)."""
    try:
        device_map = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    except (ValueError, RuntimeError) as exc:
        raise WorkerError(f"{api}(backend={backend!r}): not a backend torch knows ({exc})", rank=rank) from exc
    odd = sorted({b for b in device_map.values() if b not in REFORMABLE_BACKENDS})
    if odd:
        raise WorkerError(f"{api}(backend={backend!r}): TorchPass re-forms only "
                          f"{' and '.join(REFORMABLE_BACKENDS)} groups after a migration, not {', '.join(odd)}",
                          hint="make this group on gloo or nccl, or run the job without --torchpass", rank=rank)
    if "nccl" in device_map.values() and not dist.is_nccl_available():
        raise WorkerError(f"{api}(backend={backend!r}): this torch build has no NCCL",
                          hint="install a CUDA build of torch or use gloo", rank=rank)
    return str(dist.Backend(backend))


def _done(result: Any) -> Any:
    """A completed Work, for collectives answered locally."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class TorchPassGroup(dist.ProcessGroup):
    """A reconfigurable group: the default group, or a subgroup made from it by ``new_group``
    (DeviceMesh's dimension groups among them). ``gen`` is the generation its inner group belongs
    to (0 while local). A subgroup's identity (c10d name, global ranks, backend, options) never
    changes; the default group re-forms its subgroups with itself. Only reconfigure between
    steps, when no collective is in flight."""

    def __init__(self, backend: str, store: dist.Store | None, rank: int, world_size: int,
                 timeout: timedelta, *, local: bool, name: str = "", ranks: Sequence[int] | None = None,
                 options: Any = None, max_timeout: timedelta | None = None) -> None:
        super().__init__(rank, world_size)
        self.backend = backend
        self.timeout = timeout
        self.max_timeout = max_timeout  # cap on the timeout of subgroups made from this group
        self.gen = 0
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))  # global ranks
        self.options = options
        self.subgroups: list[TorchPassGroup] = []  # made by new_group, in creation order (same on every rank)
        self.made: collections.Counter[str] = collections.Counter()  # subgroups made per member set
        self.adopted: dict[str, TorchPassGroup] = {}  # group_identity.reconcile: the script makes them later
        self._key = name  # its store prefix under the default group's (see _store_key)
        self.destroyed = False  # destroy_process_group(this subgroup): no longer re-formed
        self._name = name
        self._desc = ""
        self._store = store  # this generation's store: subgroups made now rendezvous under it
        self.failure: BaseException | None = None  # the failed collective failed() found, this generation
        self._watched: collections.deque[Any] = collections.deque(maxlen=MAX_WATCHED)
        self._watched_step = -1
        self._inner: dist.ProcessGroup | None = None
        self._sockets: set[str] = set()  # the inner group's connections, for sever()
        self._replies: collections.deque[torch.Tensor] = collections.deque()
        if not local:
            if store is None:
                raise WorkerError("a non-local TorchPass group needs a store", rank=rank)
            self._inner = self._build(store, 1)
            self.gen = 1

    def _build(self, store: dist.Store, gen: int) -> dist.ProcessGroup:
        """The inner group of generation ``gen``, noting the sockets it opened (gloo connects to
        every member while it is built; groups are built one at a time, on the training thread)."""
        before = severing.socket_inodes()
        inner = build_inner(self.backend, store, self.rank(), self.size(), self.timeout, self._inner_name(gen),
                            self.options)
        self._sockets = severing.socket_inodes() - before
        return inner

    def _inner_name(self, gen: int) -> str:
        return f"torchpass_gen{gen}" if not self._name else f"torchpass_{self._name}_gen{gen}"

    # -- identity, as c10d and DeviceMesh read it --------------------------------------------
    # c10d keeps a group's name on its backends; this group registers none (its inner group
    # changes), so the name and description live here. c10d sets them at creation
    # (_new_process_group_helper, new_group) and registers the name for functional collectives.
    @property
    def group_name(self) -> str:
        if not self._name:
            raise RuntimeError("ProcessGroup name not set")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc or "undefined"

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group serves (object collectives pick theirs from it)."""
        if self._inner is not None:
            return self._inner._device_types
        return [torch.device(d) for d in dist.BackendConfig(dist.Backend(self.backend)).get_device_backend_map()]

    def new_group(self, ranks: Sequence[int], timeout: timedelta | None = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None) -> TorchPassGroup | None:
        """c10d's ``new_group`` (and so new_subgroups and DeviceMesh) delegates subgroup creation to
        the default group when it has this method: the subgroup is a TorchPassGroup on the same
        real backend, built now (blocks until its members have joined), re-formed with this group.
        None on a rank outside ``ranks`` (global ranks, sorted by c10d)."""
        ranks = list(ranks)
        me = self.rank()
        if me not in ranks:
            return None
        if not group_name:
            raise WorkerError("new_group without a group name", rank=me,
                              hint="TorchPass subgroups are made by torch.distributed.new_group")
        backend = check_backend(requested_backend.get() or self.backend, "new_group", me)
        early = self.adopted.pop(group_name, None)
        if early is not None:  # made by the leaving rank's script before the migration: the same group
            if (early.ranks, early.backend) != (ranks, backend):
                raise WorkerError(f"new_group {group_name!r} asks for ranks {ranks} on {backend}, but the rank this "
                                  f"process replaced had it with ranks {early.ranks} on {early.backend}",
                                  hint="every rank must make the same groups in the same order", rank=me)
            return early
        sub = self._subgroup(group_name, ranks, backend, timeout, pg_options)
        if group_desc:
            sub._set_group_desc(group_desc)
        log.get(rank=me, gen=self.gen).info("group.subgroup_made", name=group_name, ranks=ranks,
                                              backend=backend, local=self.local)
        return sub

    def _subgroup(self, name: str, ranks: list[int], backend: str, timeout: timedelta | None,
                  options: Any = None) -> TorchPassGroup:
        """A subgroup of this (default) group, built now unless this group is local, kept for the
        re-forms. Its timeout is capped by max_timeout; its members meet under _store_key."""
        timeout = timeout or self.timeout
        if self.max_timeout is not None and timeout > self.max_timeout:
            timeout = self.max_timeout
        key = self._store_key(ranks)
        store = None if self._store is None else dist.PrefixStore(f"sub/{key}/", self._store)
        sub = TorchPassGroup(backend, store, ranks.index(self.rank()), len(ranks), timeout,
                             local=self.local, name=name, ranks=ranks, options=options)
        sub.gen, sub._key = self.gen, key
        self.subgroups.append(sub)
        return sub

    def _store_key(self, ranks: list[int]) -> str:
        """Where a new subgroup's members meet in the store: its members, and how many groups of
        exactly these members came before it. Every member makes every group of its members, in
        one order, so the key is the same on each; c10d's name is not (use_local_synchronization
        and split_group hash it with the number of groups the rank is in)."""
        members = hashlib.sha1("_".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()[:16]
        key = f"{members}#{self.made[members]}"
        self.made[members] += 1
        return key

    def adopt(self, name: str, ranks: list[int], backend: str) -> None:
        """On a joining (local) rank: a subgroup the replaced rank's script made after register(),
        which this one's makes later, if at all. It is re-formed from now on (its other members
        wait for this rank there), and the script's own new_group of it gets it back."""
        if not self.local:
            raise WorkerError(f"subgroup {name!r} can only be adopted by a joining (local) rank", rank=self.rank())
        self.adopted[name] = self._subgroup(name, ranks, check_backend(backend, "new_group", self.rank()), None)
        log.get(rank=self.rank()).info("group.subgroup_adopted", name=name, ranks=ranks, backend=backend)

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
        base = dist.PrefixStore(prefix, store)
        self._rebuild(gen, base)
        # Every rank re-forms its subgroups in creation order, which is the same on every rank
        # (new_group is called by all ranks in one order): the earliest subgroup still to be
        # built always has all its members at it, so this cannot deadlock. Ranks keep their
        # numbers, so each subgroup keeps its members and their group ranks.
        live = [sub for sub in self.subgroups if not sub.destroyed]
        for sub in live:
            sub._rebuild(gen, dist.PrefixStore(f"sub/{sub._key}/", base))
        self.subgroups = live
        log.get(rank=rank, gen=gen).info("group.reformed", prefix=prefix, backend=self.backend,
                                         subgroups=[sub._name for sub in live])

    def _rebuild(self, gen: int, store: dist.Store) -> None:
        new = self._build(store, gen)
        old, self._inner, self.gen, self._store = self._inner, new, gen, store
        self._forget_works()
        if old is not None:
            # Join the old backend's threads with the GIL released (shutdown() drops it) before the
            # last reference goes; a destructor that joins them under the GIL can deadlock.
            old.shutdown()

    def shutdown(self) -> None:
        """destroy_process_group() calls this (for each group it destroys): shut the current
        inner group down. A destroyed subgroup is not re-formed any more."""
        self.destroyed = True
        if self._inner is not None:
            self._inner.shutdown()

    def sockets(self) -> set[str]:
        """The connections of this generation's inner groups, this group's and its subgroups'."""
        return set(self._sockets).union(*(sub.sockets() for sub in self.subgroups))

    def release(self) -> None:
        """Shut the inner group down and drop it, so its sockets close (shutdown() alone leaves
        gloo's listening socket open): what a worker does before criu moves it. Until the next
        reconfigure the group is local; call it only while parked."""
        for sub in self.subgroups:
            sub.release()
        inner, self._inner = self._inner, None
        self._forget_works()
        if inner is not None:
            inner.shutdown()

    def sever(self, reason: str) -> int:
        """Called from another thread while this process may sit in a collective of this group or
        of a subgroup: make every collective of this generation fail now (severing.py: gloo's
        connections shut down, NCCL aborted); failed() reports ``reason`` from then on, so the
        bootstrap treats what the script raises as an interruption. Returns the connections cut.
        A generation already abandoned (after a failed collective) has what is left of its
        connections cut too: its shutdown may still wait on a lost peer until the timeout (seen on
        gloo), holding back this rank's interruption report. A group never formed has none."""
        count = sum(sub.sever(reason) for sub in self.subgroups)
        inner = self._inner
        if inner is not None:
            if self.failure is None:
                self.failure = WorkerError(reason, rank=self.rank(), gen=self.gen)
            if "nccl" in self.backend:
                with contextlib.suppress(RuntimeError):  # already aborted or shut down
                    inner.abort()
        return count + severing.cut(self._sockets)

    def abandon(self) -> None:
        """After a failed collective: abort and shut the inner group down (closing its connections,
        so peers still waiting on this rank fail at once instead of at their timeout) and drop it;
        the group is local until the next reconfigure. Its subgroups are abandoned with it."""
        for sub in self.subgroups:
            sub.abandon()
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
        the timeout), if one did, in it or one of its subgroups: how the bootstrap tells an
        interruption from a bug in the script."""
        if self.failure is None:
            for sub in self.subgroups:
                if sub.failed() is not None:
                    self.failure = sub.failure
                    return self.failure
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

    def _local_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *_: Any) -> Any:
        """distribute_tensor (tensor parallel) scatters a freshly initialised weight from one rank.
        On a joining rank the values are placeholders that register() replaces with the donor's
        state: the source keeps its own chunk, the others zeros."""
        for i, out in enumerate(outputs):
            if inputs and inputs[i]:
                out.copy_(inputs[i][self.rank()])
            else:
                out.zero_()
        return _done(outputs)

    def _local_barrier(self, *_: Any) -> Any:
        return _done([])


_LOCAL = {
    "broadcast": TorchPassGroup._local_broadcast,
    "allgather": TorchPassGroup._local_allgather,
    "all_gather_single": TorchPassGroup._local_all_gather_single,
    "scatter": TorchPassGroup._local_scatter,
    "barrier": TorchPassGroup._local_barrier,
}


def _forwarder(name: str) -> Any:
    def forward(self: TorchPassGroup, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner
        if inner is None:
            return self._local(name, (*args, *kwargs.values()))
        return self.watch(getattr(inner, name)(*args, **kwargs))

    forward.__name__ = name
    forward.__doc__ = f"Forward ``{name}`` to the current generation's inner group."
    return forward


for _name in FORWARDED:
    setattr(TorchPassGroup, _name, _forwarder(_name))
