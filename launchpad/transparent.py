"""launchpad's side of a transparent (criu) move, for jobs run with --torchpass=transparent, whose
workers started movable (launchpad/movable.py): the commands preflight / checkpoint / discard /
resume_original (source) and prepare_restore / restore (spare) move one parked worker's process:
its memory pages by criu's page server, the rest of its images by the wormhole, its stdout/stderr
re-attached to this launchpad's pipes. Dump, transfer and restore are timed in the acks. Deciding
when to move and what to do on a failure is torchpassd's job."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criu_hooks import image_owner, node_files, preflight, proc_sockets, runner
from criu_hooks import spawn as criu_spawn
from criu_hooks.errors import CriuFailed, CriuUnavailable
from launchpad import workers
from launchpad.channel import WorkerLink
from launchpad.node_context import NodeContext
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.errors import CannotMove, MigrationError, ProtocolError, TorchPassError, WorkerError
from torchpass_common.transfer_address import TransferAddress

_SOCKETS_CLOSED_S = 10.0


class Adopted:
    """A restored worker as a Worker's ``proc``: criu left it to this launchpad (a child subreaper),
    which reaps it from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = loop.create_future()

        def reap() -> None:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            loop.call_soon_threadsafe(self._finish, code)
        threading.Thread(target=reap, name=f"reap-{pid}", daemon=True).start()

    def _finish(self, code: int) -> None:
        self.returncode = code
        if not self._done.done():
            self._done.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


@dataclass
class _Incoming:
    """A spare's half of one move, from prepare_restore to restore."""

    images: Path
    server: runner.PageServer
    state: asyncio.Future[Any]


def _where(agent: NodeContext, migration: str, **more: Any) -> dict[str, Any]:
    return {"job": agent.spec.job, "node": agent.node, "migration": migration, **more}


class Transparent:
    """The transparent-move commands of one launchpad (merged into Commands.handlers)."""

    def __init__(self, agent: NodeContext) -> None:
        self.agent = agent
        self.incoming: dict[str, _Incoming] = {}
        self.originals: dict[str, workers.Worker] = {}  # migration -> the dumped, stopped worker
        self.node_files: dict[str, node_files.Collected] = {}  # migration -> what its tree held in /dev/shm
        self.handlers = {"preflight": self.preflight, "prepare_restore": self.prepare_restore,
                         "checkpoint": self.checkpoint, "restore": self.restore, "discard": self.discard,
                         "resume_original": self.resume_original}
        atexit.register(self._stop_servers)

    # ---- helpers ---------------------------------------------------------------------------
    def _worker(self, rank: int) -> tuple[WorkerLink | None, workers.Worker]:
        group = self.agent.group
        for w in (group.workers.values() if group else ()):
            link = self.agent.channel.links.get(w.pid)
            if w.returncode is None and (link.rank if link else w.rank) == rank and not (link and link.joining):
                return link, w
        raise WorkerError("no running (non-joining) worker has this rank here", rank=rank, node=self.agent.node)

    def _fault(self, kind: str) -> bool:
        """The site config asks this CRIU step to fail (faults.criu, drills and tests only): "dump"
        runs criu dump without --tcp-close, which criu refuses for the worker's live store
        connection; "restore" loses the memory pages on the way. The flow must then keep or bring
        back the original worker."""
        if self.agent.config.faults.criu != kind:
            return False
        log.get(node=self.agent.node).warning("criu.fault_injected", step=kind, hint="faults.criu is set in the site config")
        return True

    def _stop_servers(self) -> None:
        for inc in self.incoming.values():
            inc.server.stop()

    async def _reattached(self, pid: int, old: WorkerLink | None, rank: int) -> None:
        """Until the worker ``pid`` has said hello again (a new link) on this launchpad's channel."""
        deadline = time.monotonic() + self.agent.timeouts.reform
        while time.monotonic() < deadline:
            link = self.agent.channel.links.get(pid)
            if link is not None and link is not old and link.connected:
                return
            await asyncio.sleep(0.02)
        raise WorkerError(f"the worker did not reconnect within {self.agent.timeouts.reform:.0f} s", rank=rank,
                          pid=pid, node=self.agent.node)

    def _tell(self, w: workers.Worker, rank: int) -> None:
        """Write ``reconnect PATH`` (this launchpad's channel) into the worker's control pipe."""
        if w.control is None:
            raise WorkerError("this worker has no control pipe (not started movable)", rank=rank)
        os.write(w.control, f"reconnect {self.agent.channel.path}\n".encode())

    # ---- source ----------------------------------------------------------------------------
    async def preflight(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Before anything is paused: why worker ``rank`` cannot be moved with criu (empty: it can),
        and whether its script registered save/load (then a model-aware move is the fallback)."""
        rank = _int(args, "rank")
        link, w = self._worker(rank)
        reasons = await asyncio.to_thread(preflight.reasons, w.pid)
        if w.control is None:
            reasons.append(f"worker rank {rank} was not started movable: the job runs without "
                           "--torchpass=transparent")
        return {"reasons": reasons, "registered": bool(link and link.registered), "pid": w.pid}

    async def checkpoint(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Move the parked workers named in ``moves`` ({rank, page_port, images}), side by side:
        detach each, criu-dump it (pages to the spare's page server at ``page_host``), and send its
        other images by the wormhole to ``images``. A dumped worker stays stopped here until discard
        or resume_original. A failed dump
        leaves that worker running here (reconnected, still parked) and the ack is the error."""
        moves = _moves(args)
        results = await asyncio.gather(*(self._checkpoint_one(m, args, migration) for m in moves),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for m, r in zip(moves, results, strict=True):  # the others go on here too
                if not isinstance(r, BaseException):
                    await self.resume_original({"rank": m.rank}, gen, migration)
            raise failed[0]
        if len(results) == 1:
            return results[0]
        return {"dump_s": max(r["dump_s"] for r in results), "frozen_s": max(r["frozen_s"] for r in results),
                "image_bytes": sum(r["image_bytes"] for r in results),
                "transfer_s": max(r["transfer_s"] for r in results),
                "transfer_bytes": sum(r["transfer_bytes"] for r in results), "pid": [r["pid"] for r in results]}

    async def _checkpoint_one(self, move: _Move, args: dict[str, Any], migration: str) -> dict[str, Any]:
        rank = move.rank
        where = _where(self.agent, migration, rank=rank)
        page = (str(args.get("page_host")), move.page_port)
        dest = move.images
        link, w = self._worker(rank)
        if link is None or w.control is None:
            raise MigrationError("the worker is not movable or not connected", hint="see preflight", **where)
        timeouts = self.agent.timeouts
        await self.agent.channel.request(link, ac.message(ac.DETACH), lambda r: r["t"] == ac.DETACHED, timeouts.reform)
        await link.chan.close()
        await _sockets_closed(w.pid, where)
        ctl_fd = _control_fd_of(w)
        pipes = {str(fd): name for fd, name in criu_spawn.stdio_pipes(w.pid).items()}  # msgpack: str keys
        resources = {"pipes": pipes, "control": os.readlink(f"/proc/{w.pid}/fd/{ctl_fd}")}
        images = self.agent.scratch / f"dump-{migration[:12]}-{rank}"
        fault = self._fault("dump")
        try:
            dumped = await asyncio.to_thread(runner.dump, w.pid, images, tcp_close=not fault, page_server=page,
                                             timeout=timeouts.decision, where=where)
        except (CriuFailed, CriuUnavailable) as exc:
            await asyncio.to_thread(node_files.drop_remaps, runner.tree(w.pid))
            self._tell(w, rank)  # criu left it running: back on this channel, still parked
            await self._reattached(w.pid, link, rank)
            raise MigrationError(f"criu dump failed, rank {rank} goes on here: {exc.message}", **where) from exc
        self.originals[_key(migration, rank)] = w
        try:
            held = await asyncio.to_thread(node_files.collect, runner.tree(w.pid), images)
        except OSError as exc:
            await self.resume_original({"rank": rank}, 0, migration)
            raise MigrationError(f"copying what rank {rank} holds in /dev/shm failed, it goes on here: {exc}",
                                 **where) from exc
        self.node_files[_key(migration, rank)] = held
        resources["node_files"] = held.files.to_wire()
        from launchpad.wormhole import File, send_state  # imports torch (seconds): not at launchpad's start

        t0 = time.monotonic()
        files = {f.name: File(f) for f in sorted(images.iterdir()) if f.is_file()}
        try:
            stats = await asyncio.to_thread(send_state, {"resources": resources, "files": files},
                                            dest.host, dest.port, dest.token,
                                            timeout=timeouts.reform, context=where)
        except TorchPassError as exc:
            await self.resume_original({"rank": rank}, 0, migration)
            raise MigrationError(f"sending the images failed, rank {rank} goes on here: {exc.message}",
                                 **where) from exc
        return {"dump_s": round(dumped.seconds, 4), "frozen_s": dumped.frozen_seconds,
                "image_bytes": dumped.image_bytes, "transfer_s": round(time.monotonic() - t0, 4),
                "transfer_bytes": stats.bytes, "pid": w.pid}

    async def discard(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """The move succeeded: kill the stopped originals of ``ranks`` (or ``rank``; their PID
        namespaces go with them)."""
        gone = []
        for rank in _ranks(args):
            w = self.originals.pop(_key(migration, rank), None)
            if w is None:
                continue
            w.moved = True
            runner.discard_original(w.pid)
            if held := self.node_files.pop(_key(migration, rank), None):
                node_files.release(held)
            if w.control is not None:
                os.close(w.control)
                w.control = None
            gone.append(w.pid)
        return {"discarded": (gone[0] if len(gone) == 1 else gone) if gone else None}

    async def resume_original(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """The move failed after the dump: let the stopped originals of ``ranks`` (or ``rank``) go on
        here, reconnected and still parked (they re-form with the others). A no-op for one never
        detached."""
        resumed = []
        for rank in _ranks(args):
            w = self.originals.pop(_key(migration, rank), None)
            if w is None:
                continue
            self.node_files.pop(_key(migration, rank), None)  # its tree holds them on here
            old = self.agent.channel.links.get(w.pid)
            runner.resume_original(w.pid)
            self._tell(w, w.rank)
            await self._reattached(w.pid, old, w.rank)
            resumed.append(w.pid)
        return {"resumed": (resumed[0] if len(resumed) == 1 else resumed) if resumed else None}

    # ---- spare -----------------------------------------------------------------------------
    async def prepare_restore(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Before the dump: for each of ``moves`` ({rank, page_port, images}) a criu page server on
        ``page_host:page_port`` and a wormhole receiver on ``images`` for the other images."""
        runner.become_subreaper()  # restored workers become this launchpad's children
        images = {}
        for move in _moves(args):
            key = _key(migration, move.rank)
            if key not in self.incoming:
                self.incoming[key] = await self._incoming(key, move, args, _where(self.agent, migration))
            images[str(move.rank)] = str(self.incoming[key].images)
        return {"images": next(iter(images.values())) if len(images) == 1 else images}

    async def _incoming(self, key: str, move: _Move, args: dict[str, Any],
                        where: dict[str, Any]) -> _Incoming:
        migration, rank = key.split("/")
        from launchpad.wormhole import StateReceiver  # imports torch (seconds): not at launchpad's start

        images = self.agent.scratch / f"restore-{migration[:12]}-{rank}"  # one directory per moving worker
        try:
            server = await asyncio.to_thread(runner.PageServer, images, str(args.get("page_host")),
                                             move.page_port, where=where)
        except (CriuFailed, CriuUnavailable) as exc:
            raise MigrationError(f"cannot receive the worker's pages: {exc.message}", **where) from exc
        try:
            rx = StateReceiver(move.images.host, move.images.port, move.images.token, files_dir=images, context=where)
        except TorchPassError:
            server.stop()
            raise
        return _Incoming(images, server, asyncio.wrap_future(rx.start(self.agent.timeouts.decision)))

    async def restore(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Restore the workers dumped for ``migration`` here as ``ranks`` (or ``rank``), side by
        side, their output re-attached to this launchpad, and wait until each has reconnected
        (parked, for the re-form)."""
        ranks = _ranks(args)
        results = await asyncio.gather(*(self._restore_one(rank, local, migration) for local, rank in enumerate(ranks)))
        if len(results) == 1:
            return results[0]
        return {"restore_s": max(r["restore_s"] for r in results), "pid": [r["pid"] for r in results],
                "page_bytes": sum(r["page_bytes"] for r in results)}

    async def _restore_one(self, rank: int, local_rank: int, migration: str) -> dict[str, Any]:
        where = _where(self.agent, migration, rank=rank)
        inc = self.incoming.pop(_key(migration, rank), None)
        if inc is None:
            raise MigrationError("restore before prepare_restore", hint="torchpassd sends prepare_restore first",
                                 **where)
        group = self.agent.group
        if group is None:
            inc.server.stop()
            raise WorkerError("no worker group on this launchpad", **where)
        try:
            received = await inc.state
            pages = await asyncio.to_thread(inc.server.wait, self.agent.timeouts.reform)
        except TorchPassError as exc:
            inc.server.stop()
            raise MigrationError(f"the worker's images did not arrive: {exc.message}", **where) from exc
        if self._fault("restore"):
            for f in inc.images.glob("pages-*.img"):
                f.unlink()
        res = received["resources"]
        held = node_files.NodeFiles.from_wire(res.get("node_files"))
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        try:
            inherit, readers = {}, {}
            for resource in sorted(set(res["pipes"].values())):
                r, wfd = os.pipe()
                fds += [r, wfd]
                inherit[resource], readers[resource] = wfd, r
            ctl_r, ctl_w = os.pipe()
            fds += [ctl_r]
            inherit[res["control"]] = ctl_r
            placed: list[str] = []
            try:  # images from the network restore only as this job's user (criu may run privileged)
                image_owner.check(inc.images, uid=os.getuid(), gids={os.getgid(), *os.getgroups()}, where=where)
                placed = node_files.place(held, inc.images)
                restored = await asyncio.to_thread(runner.restore, inc.images, inherit=inherit,
                                                   timeout=self.agent.timeouts.decision, where=where)
            except (CriuFailed, CriuUnavailable) as exc:
                node_files.unplace(placed)
                os.close(ctl_w)
                raise CannotMove(f"criu restore failed: {exc.message}",
                                 hint="the original worker is still on its node, stopped: resume it",
                                 **where) from exc
            streams, seen = [], set()
            for fd in ("1", "2"):  # one reader per pipe (stdout and stderr may share one)
                resource = res["pipes"].get(fd)
                fresh = resource is not None and resource not in seen
                streams.append(await workers.pipe_reader(os.dup(readers[resource])) if fresh else _empty(loop))
                seen.add(resource)
        finally:
            for fd in fds:
                os.close(fd)
        w = workers.Worker(rank, local_rank, Adopted(restored.pid), control=ctl_w)
        w.pumps = workers.pump_output(group.router, rank, w.local_rank, *streams)
        group.adopt(w)
        self._tell(w, rank)
        try:
            await self._reattached(w.pid, None, rank)
        except WorkerError:
            await w.stop(signal.SIGKILL, 1.0)
            raise
        log.get(**where).info("transparent.restored", pid=w.pid, seconds=round(restored.seconds, 4), pages=pages)
        return {"restore_s": round(restored.seconds, 4), "pid": w.pid, "page_bytes": pages}


def _key(migration: str, rank: int) -> str:
    """One worker's move within a migration (a node's several workers move in one migration)."""
    return f"{migration}/{rank}"


@dataclass(frozen=True)
class _Move:
    """One worker's move: its rank, the spare's criu page server port, and where its other images go
    (checkpoint: the spare's receiver) or are received (prepare_restore: the address to listen on)."""

    rank: int
    page_port: int
    images: TransferAddress


def _moves(args: dict[str, Any]) -> list[_Move]:
    """``moves``: a non-empty list of {rank, page_port, images (a TransferAddress)}."""
    raw = args.get("moves")
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise ProtocolError(f"'moves' must be a non-empty list of {{rank, page_port, images}} maps, got {raw!r}")
    return [_Move(_int(m, "rank"), _int(m, "page_port"), TransferAddress.parse(m.get("images"), "a move's 'images'"))
            for m in raw]


def _ranks(args: dict[str, Any]) -> list[int]:
    """``ranks`` (a list) or the one ``rank``."""
    raw = args.get("ranks")
    if raw is None:
        return [_int(args, "rank")]
    if not isinstance(raw, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
        raise ProtocolError(f"'ranks' must be a list of ranks, got {raw!r}")
    return raw


def _int(args: dict[str, Any], name: str) -> int:
    value = args.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"command argument {name!r} must be an integer, got {value!r}")
    return value


def _control_fd_of(w: workers.Worker) -> int:
    environ = Path(f"/proc/{w.pid}/environ").read_bytes().split(b"\0")
    value = next((e.split(b"=", 1)[1] for e in environ if e.startswith(ac.ENV_CONTROL_FD.encode() + b"=")), b"")
    if not value.isdigit():
        raise WorkerError("the worker's environment names no control pipe", pid=w.pid, rank=w.rank)
    return int(value)


async def _sockets_closed(pid: int, where: dict[str, Any]) -> None:
    """Until the worker holds no unix socket (it closes the agent channel after detached): criu
    refuses a connected unix stream socket whose peer is outside the dumped tree."""
    deadline = time.monotonic() + _SOCKETS_CLOSED_S
    while True:
        held = {f"socket:[{i}]" for i in proc_sockets.held(pid) & proc_sockets.unix().keys()}
        if not held:
            return
        if time.monotonic() > deadline:
            log.get(**where).warning("transparent.unix_sockets_left", sockets=sorted(held))
            return  # criu says what it cannot dump
        await asyncio.sleep(0.02)


def _empty(loop: asyncio.AbstractEventLoop) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(loop=loop)
    reader.feed_eof()
    return reader
