"""The worker's end of launchpad's commands. A reader thread receives commands (and answers a
pause for a step boundary already gone past at once); the training thread carries them out at step
boundaries: it reports each step, parks after the step launchpad chose (where the next iteration
starts: park_point), and while parked saves (hand-over), re-forms, resumes or exits.
A joining rank parks inside register() after loading the donor's state. No collective is added to
any step."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchpass import (
    busy_time,
    criu_park,
    ddp_layout,
    default_group,
    group_identity,
    handover,
    layout,
    park_point,
    recovery,
    steps,
)
from torchpass_common import agent_channel as ac
from torchpass_common import collective_path, log, worker_state
from torchpass_common.errors import TorchPassError, WorkerError
from torchpass_common.timeouts import Timeouts
from torchpass_common.transfer_address import TransferAddress
from torchpass_common.worker_state import WorkerState

_GONE = {"t": "_agent_gone"}  # queued by the reader thread when launchpad closes the socket
# Step reports are thinned to one per this many seconds: launchpad then wakes at most ~10 times a
# second per worker however short the steps (each wake-up is CPU taken from training on a busy
# node; at 0.01 s launchpad used 2.2% of a core beside two 3 ms-step workers, at 0.1 s 0.55%).
# torchpassd's pause step allows 1.5 s of running ahead, so 0.1 s of staleness costs nothing. A
# slower step is reported every time; a pending command or a newly registered save() is reported
# at once. The step a worker parks or answers at always travels with its reply.
REPORT_EVERY_S = 0.1


class Agent:
    """One per worker process, created by the bootstrap when TORCHPASS_AGENT_SOCKET is set. Its
    lifecycle (``state``, ``joining``, ``recovering``: worker_state.Lifecycle) moves only with the
    messages it sends, by the same table launchpad applies to them."""

    def __init__(self, chan: ac.SyncChannel, *, rank: int, local_rank: int, joining: bool,
                 timeouts: Timeouts | None = None) -> None:
        self.chan = chan
        self.rank = rank
        self.local_rank = local_rank
        self.state, self.joining, self.recovering = WorkerState.STARTING, joining, False
        self.timeouts = timeouts or Timeouts()
        self.save_fn: Callable[[], Any] | None = None
        self.load_fn: Callable[[Any], None] | None = None
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._wake = False  # set by the reader thread; the only thing a step boundary checks
        # Orders a pause's arrival (reader thread) against the step boundaries the training thread
        # goes on from, and every message sent: see _too_late.
        self._order = threading.RLock()
        self._passed = -1  # the last step boundary this rank went on from, running (not parking there)
        self._pause: dict[str, Any] | None = None
        self._gone = False
        self.log = log.get(rank=rank)
        self.rejoin: recovery.Rejoin | None = None  # set while a survivor re-enters its script, until loaded
        self._reported: tuple[float, bool] = (-REPORT_EVERY_S, False)  # (when, registered) of the last report
        self._armed: tuple[int, list[park_point.Hook]] | None = None  # (gen, hooks) waiting for the next iteration
        self._forwardless = False  # a step ran without any module forward: park at the step boundary
        self._layout_sent = False
        self._busy = busy_time.BusyMeter()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        hello = ac.message(ac.HELLO, rank=self.rank, local_rank=self.local_rank, pid=criu_park.host_pid(),
                           joining=self.joining)
        self._advance(hello)
        self.chan.send(hello)
        threading.Thread(target=self._read, name="torchpass-agent", daemon=True).start()
        steps.on_boundary(self._on_boundary)

    def _read(self) -> None:
        while True:
            try:
                msg = self.chan.recv()
            except (OSError, TorchPassError) as e:
                self.log.error("agent.read_failed", error=str(e))
                msg = None
            if msg is not None and msg["t"] == ac.SEVER:
                self._sever(str(msg.get("reason") or "a peer of this job was lost"))
                continue
            if msg is not None and msg["t"] == ac.PING:
                self.send(ac.message(ac.PONG))
                continue
            if msg is not None and msg["t"] == ac.PAUSE and self._too_late(msg):
                continue
            self._commands.put(msg if msg is not None else _GONE)
            self._wake = True
            if msg is None:
                return

    def _too_late(self, pause: dict[str, Any]) -> bool:
        """On the reader thread: a pause for a step boundary this rank already went on from is
        answered missed at once (launchpad fails the pause, torchpassd picks a later step or rolls
        back, and either frees the ranks that did park there). Left to the next boundary, the answer
        would wait for this rank's current step, whose collectives wait on those parked ranks:
        until the collective timeout, which interrupts the job."""
        with self._order:
            late = self.state is WorkerState.RUNNING and pause["at_step"] <= self._passed
            if late:
                self._missed(pause["gen"], steps.current(), at_step=pause["at_step"])
        return late

    def _sever(self, reason: str) -> None:
        """On the reader thread: cut the running generation's collectives (group.sever), so a
        training thread waiting in one with a lost peer raises now and is interrupted; one that is
        between collectives raises at its next; one tearing a failed generation down is freed from
        its shutdown's wait on the lost peer. Nothing to cut while recovering or before the group
        is formed."""
        group = default_group.group()
        if group is None or self.recovering:
            self.log.info("agent.sever_ignored", reason=reason, recovering=self.recovering)
            return
        cut = group.sever(reason)
        self.log.warning("agent.severed", gen=group.gen, step=steps.current(), connections=cut, reason=reason)

    # -- running ---------------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        """Send to launchpad; if it is gone, note it and carry on training."""
        with self._order:  # from either thread: the state follows the messages in the order sent
            self._advance(msg)
            if self._gone:
                return
            try:
                self.chan.send(msg)
            except OSError as e:
                self.log.error("agent.send_failed", error=str(e), kind=msg["t"])
                self._agent_gone()

    def _advance(self, msg: dict[str, Any]) -> None:
        before = self.state
        if not worker_state.advance(self, msg):  # a bug in this library: say so, the message still goes
            self.log.warning("agent.unexpected_move", kind=msg["t"], before=before, after=self.state)

    def _on_boundary(self, step: int) -> None:
        if self._armed is not None:
            self._disarm_forwardless(step)
        now, registered = time.monotonic(), self.save_fn is not None  # registered: a model-aware move is possible
        last_at, last_registered = self._reported
        if self._wake or registered != last_registered or now - last_at >= REPORT_EVERY_S:
            self._reported = (now, registered)
            report = {"t": ac.STEP, "step": step, "registered": registered}
            if (busy := self._busy.per_step(step)) is not None:  # CPU it wanted a step: the straggler signal
                report["busy"] = busy
            if not self._layout_sent:  # once: which ranks hold this rank's state (torchpassd's donors)
                self._layout_sent, report["replicas"] = True, self._replicas()
            self.send(report)
        with self._order:  # a pause that arrives after this finds the boundary passed (_too_late)
            park_now = self._serve_running(step) if self._wake else None
            if park_now is None and self._armed is None:
                self._passed = step
        if park_now is not None:
            self._park_paused(park_now)

    def _replicas(self) -> list[int] | None:
        """layout.replicas, or None (unknown) if reading the layout fails: training goes on."""
        try:
            return layout.replicas(self.rank)
        except Exception as exc:  # an odd mesh or group must not cost a training step
            self.log.warning("agent.layout_unknown", error=repr(exc))
            return None

    def _serve_running(self, step: int) -> int | None:
        """Carry out what the reader thread queued; the generation to park in at once when this
        boundary is the pause step of a script whose steps run no module forward, else None."""
        self._wake = False  # before draining, so a command queued meanwhile wakes the next boundary
        while True:
            try:
                msg = self._commands.get_nowait()
            except queue.Empty:
                break
            if msg["t"] == ac.PAUSE:
                self._pause = msg
            elif msg["t"] == ac.EXIT:
                self.exit()
            elif msg is _GONE:
                self._agent_gone()
            else:
                self.error(f"{msg['t']} received while running; only pause and exit are valid then")
        if self._pause is not None:
            self._wake = True  # keep checking every boundary until the pause step
            gen, at_step = self._pause["gen"], self._pause["at_step"]
            if step > at_step:
                self._pause = None
                self._missed(gen, step, at_step=at_step)
            elif step == at_step:
                self._pause = None
                self._wake = not self._commands.empty()
                return self._park_before_next_forward(gen)
        return None

    def _park_before_next_forward(self, gen: int) -> int | None:
        """Park where the next iteration starts (park_point). A script seen running a whole step
        without any module forward parks at once from then on (returns ``gen`` to park in now)."""
        if self._forwardless:
            return gen

        def park_here() -> None:
            self._armed = None
            self._park_paused(gen)

        self._armed = (gen, park_point.arm(park_here))
        return None

    def _disarm_forwardless(self, step: int) -> None:
        """A whole step ran without the forward the pause waited for: this script's steps run no
        module forward. The pause is missed (torchpassd tries again); the next one parks at once."""
        assert self._armed is not None
        gen, hooks = self._armed
        park_point.disarm(hooks)
        self._armed, self._forwardless = None, True
        self._missed(gen, step, why="a step ran without any module forward")

    def _missed(self, gen: int, step: int, *, at_step: int | None = None, why: str | None = None) -> None:
        """Answer pause ``gen`` missed: this rank is at ``step``, past ``at_step`` where it was asked
        to park. A ``why`` is something the user's script does (a warning); a pause that arrived a
        step late is routine (info): torchpassd asks again."""
        self.send(ac.message(ac.PAUSE_MISSED, gen=gen, step=step))
        if why is not None:
            self.log.warning("agent.pause_missed", gen=gen, step=step, why=why)
        else:
            self.log.info("agent.pause_missed", gen=gen, at_step=at_step, step=step)

    def _park_paused(self, gen: int) -> None:
        step = steps.current()
        self.send(ac.message(ac.PAUSED, gen=gen, step=step))
        self.log.info("agent.paused", gen=gen, step=step)
        self.park()

    # -- parked ----------------------------------------------------------------------------
    def park(self) -> None:
        """Carry out commands until resume (returns), a pause for a later step (returns, to park
        there) or exit. A failed command is reported as an error; the rank stays parked."""
        deadline = time.monotonic() + self.timeouts.decision * 2
        while True:
            msg = self.command(deadline, "parked", "a resume", hint="launchpad lost track of this rank")
            try:
                if self._on_parked(msg):
                    with self._order:  # trains on from this boundary
                        self._passed = steps.current()
                    return
            except Exception as e:  # user save() or a collective failed: report it, stay parked
                self.error(f"{msg['t']} failed: {e}")

    def _on_parked(self, msg: dict[str, Any]) -> bool:
        kind, step = msg["t"], steps.current()
        if kind == ac.SAVE:
            self._save(msg["dest"])
        elif kind == ac.REFORM:
            self._reform(msg)
        elif kind == ac.RESUME:
            self.send(ac.message(ac.RESUMED, gen=msg["gen"]))
            self.log.info("agent.resumed", gen=msg["gen"], step=step)
            self._wake = not self._commands.empty()
            return True
        elif kind == ac.EXIT:
            self.exit()
        elif kind == ac.DETACH:  # transparent mode: criu moves this process now (criu_park)
            criu_park.detach(self)
        elif kind == ac.PAUSE and msg["at_step"] > step:
            self._pause, self._wake = msg, True  # go on training and park again there
            return True
        elif kind == ac.PAUSE:
            reply = ac.PAUSED if msg["at_step"] == step else ac.PAUSE_MISSED
            self.send(ac.message(reply, gen=msg["gen"], step=step))
        return False

    def _save(self, dest: dict[str, Any]) -> None:
        if self.save_fn is None:
            raise WorkerError("asked to hand over state, but the script never called torchpass.register()",
                              hint="call torchpass.register(save=..., load=...) before training",
                              rank=self.rank)
        to = handover.address(dest, "save's 'dest'", rank=self.rank,  # refused before the user's save() runs
                              hint="launchpad and torchpass disagree on the agent channel")
        t0 = time.perf_counter()
        rec = self.capture(steps.current())
        size = handover.send(rec, to, rank=self.rank)
        seconds = time.perf_counter() - t0
        self.send(ac.message(ac.SAVED, bytes=size, seconds=seconds))
        self.log.info("agent.saved", step=steps.current(), bytes=size, seconds=round(seconds, 4))

    def capture(self, step: int) -> dict[str, Any]:
        """The hand-over record of this rank after ``step``: its save() state, DDP's bucket layout
        and the identities of its process groups (which a joining rank checks against its own)."""
        assert self.save_fn is not None
        group = default_group.group()
        return handover.record(self.save_fn(), step, ddp_layout.capture(), rank=self.rank,
                               groups=group_identity.identities(group) if group is not None else [])

    def _reform(self, msg: dict[str, Any]) -> None:
        group = _require_group(self.rank)
        gen = msg["gen"]
        if gen != group.gen:  # a repeated reform of the current generation is only re-acknowledged
            t0 = time.perf_counter()
            if msg.get("ifname"):  # the new generation's collectives take this interface (a reroute)
                collective_path.use(os.environ, collective_path.check(msg["ifname"], "reform's 'ifname'"))
            store = dist.TCPStore(msg["store_host"], msg["store_port"], is_master=False,
                                  timeout=timedelta(seconds=self.timeouts.reform), wait_for_workers=False)
            group.reconfigure(gen, msg["rank"], msg["world_size"], store, msg["prefix"])
            self.log.info("agent.reformed", gen=gen, seconds=round(time.perf_counter() - t0, 4))
        self.send(ac.message(ac.REFORMED, gen=gen))

    def exit(self) -> None:
        """Leave the job: this rank's state has been handed over (or the job is ending). The
        process ends at once: tearing down DDP and a communicator whose peers moved on can hang.
        A rank told to exit while recovering ends as failed: the job was given up."""
        if self.recovering:
            self.log.error("agent.exit_interrupted", step=steps.current())
        else:
            self.log.info("agent.exit", step=steps.current())
        self.chan.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(recovery.EXIT_INTERRUPTED if self.recovering else 0)

    def drop_pause(self) -> None:
        """Forget a pause launchpad asked for: the rank was interrupted before reaching its step."""
        self._pause = None

    def next_command(self, deadline: float) -> dict[str, Any]:
        """The next command from launchpad (``{"t": "_agent_gone"}`` once it closed the channel);
        queue.Empty at ``deadline`` (time.monotonic())."""
        return self._commands.get(timeout=max(0.0, deadline - time.monotonic()))

    def command(self, deadline: float, waiting: str, awaited: str, *, hint: str) -> dict[str, Any]:
        """The next command for a rank that is ``waiting`` (parked, interrupted) for ``awaited``; a
        WorkerError when none comes by ``deadline`` (the wait's bound: timeouts.decision x 2) or
        launchpad went away."""
        try:
            msg = self.next_command(deadline)
        except queue.Empty:
            raise WorkerError(f"{waiting} {self.timeouts.decision * 2:.0f} s without {awaited}", hint=hint,
                              rank=self.rank, step=steps.current()) from None
        if msg is _GONE:
            self._agent_gone()
            raise WorkerError(f"launchpad went away while this rank was {waiting}", rank=self.rank,
                              step=steps.current(), hint="the job cannot continue without its agent")
        return msg

    def recover(self, exc: BaseException) -> None:
        """After an interruption (``exc`` left the script): capture and report, wait for
        launchpad's recover; on return the script runs again and its register() loads."""
        self.rejoin = recovery.interrupt(self, exc)

    def must_load(self) -> bool:
        """Does register() load a running rank's state now: a joiner that has not joined yet, or a
        survivor re-entering its script after a recover."""
        return self.rejoin is not None or (self.joining and self.state is WorkerState.RUNNING)

    def reconnect(self, chan: ac.SyncChannel) -> None:
        """Talk to launchpad through ``chan`` from now on (a worker criu restored elsewhere): hello
        again and a new reader thread."""
        self.chan, self._gone = chan, False
        self.start()

    def _agent_gone(self) -> None:
        if not self._gone:
            self._gone = True
            self.log.warning("agent.gone", step=steps.current())

    def error(self, text: str) -> None:
        """Report a failed command to launchpad (and the log); the rank carries on."""
        self.log.error("agent.command_failed", error=text, step=steps.current())
        self.send(ac.message(ac.ERROR, msg=text))

    # -- joining ---------------------------------------------------------------------------
    def join(self) -> None:
        """On a joining rank, inside register(): receive the donor's state, bring DDP to its bucket
        layout, load it, report joined, and park until re-formed and resumed."""
        group = _require_group(self.rank)
        if self.save_fn is None or self.load_fn is None:
            raise WorkerError("a joining rank needs both save and load in torchpass.register()",
                              rank=self.rank)
        rejoin = self.rejoin
        source = rejoin.source if rejoin else self._join_source()
        t0 = time.perf_counter()
        while True:
            try:
                rec, own = self._receive(source)
                break
            except Exception as exc:
                if rejoin is None:
                    self.error(f"receiving the state failed: {exc}")  # the migration's reason
                    raise
                # a survivor whose donor's stream broke keeps its own state and waits for a new recover
                self.error(f"loading the donor's state failed: {exc}; this rank keeps its own state "
                            f"(step {rejoin.step}), send recover again")
                rejoin = recovery.wait_for_recover(self, rejoin.own, rejoin.step, rejoin.gen, str(exc))
                source = rejoin.source
        meta, user = rec["torchpass"], rec["user"]
        if meta.get("rank") == self.rank:  # the replaced rank's own record (not a replica's)
            try:
                adopted = group_identity.reconcile(group, meta.get("groups", []), rank=self.rank)
            except WorkerError as exc:
                self.error(str(exc))  # the migration's reason; then the script fails here
                raise
            if adopted:
                self.log.info("agent.groups_adopted", names=adopted)
        if handover.has_local_shards(user):
            user = handover.sharded_like(user, own if own is not None else self.save_fn(), rank=self.rank)
        ddp_layout.replay(group, meta["ddp"])
        self.load_fn(user)
        steps.restore(meta["step"])
        extra = {"bytes": rejoin.donated_bytes, "seconds": rejoin.donated_seconds} if rejoin else {}
        self.rejoin = None  # the own state of a survivor is loaded; drop it (it holds the old model)
        self.send(ac.message(ac.JOINED, step=meta["step"], **extra))
        self.log.info("agent.joined", step=meta["step"], seconds=round(time.perf_counter() - t0, 4),
                       recovered=rejoin is not None)
        del rec, rejoin, source, own, user
        self.park()

    def _join_source(self) -> TransferAddress:
        """Where a joining rank receives its state: TORCHPASS_JOIN_SOURCE, set by launchpad."""
        try:
            raw = json.loads(os.environ.get(ac.ENV_JOIN_SOURCE, "null") or "null")
        except ValueError:
            raw = None
        return handover.address(raw, ac.ENV_JOIN_SOURCE, rank=self.rank,
                                hint="launchpad sets it when it starts a joiner")

    def _receive(self, source: dict[str, Any] | TransferAddress) -> tuple[dict[str, Any], Any]:
        """The hand-over record from ``source``: a joiner's donor, or a re-entered survivor's own
        state ({"record": ...}) or its donor's (a survivor that lagged one step behind); and this
        rank's own save() state when it was taken here (the wormhole's receive template, filled in
        place on a fresh joiner: a failed receive ends it anyway; a survivor's is kept intact), else None."""
        if isinstance(source, dict):
            self.send(ac.message(ac.READY))
            return source["record"], None
        assert self.save_fn is not None
        own = self.save_fn()
        incoming = handover.Incoming(source, rank=self.rank, template=None if own is None else handover.record(own, 0, []),
                                     in_place=self.rejoin is None)  # a fresh joiner: nothing of its own to keep
        self.send(ac.message(ac.READY))
        return incoming.receive(self.timeouts.decision), own


def _require_group(rank: int) -> Any:
    group = default_group.group()
    if group is None:
        raise WorkerError("no TorchPass process group: the script has not called init_process_group",
                          hint="call torch.distributed.init_process_group before torchpass.register()",
                          rank=rank)
    return group
