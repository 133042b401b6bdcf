"""Unplanned interruption of a worker whose peer died: telling a failed collective from a bug in
the script, the just-in-time state (the registered save(), taken when the exception has left the
script: parameters of the last completed step), tearing the failed generation down, reporting
INTERRUPTED, and carrying out launchpad's recover (donate the state, then re-enter the script,
whose register() loads it through Agent.join). Re-entering is the bootstrap's loop; launchpad's
side is launchpad/commands.py ``recover``."""

from __future__ import annotations

import contextlib
import socket
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchpass import ddp_layout, default_group, handover, steps
from torchpass_common import agent_channel as ac
from torchpass_common.errors import WorkerError
from torchpass_common.transfer_address import TransferAddress

if TYPE_CHECKING:
    from torchpass.agent import Agent

_GRACE = 0.5  # s: a failed collective's work may complete a moment after the error reached the script
_POLL = 0.05
_GLOO_TRANSPORT = "gloo/transport/"  # in the text of every error of gloo's connections (tcp/pair.cc ...)
EXIT_INTERRUPTED = 75  # exit code of an interrupted worker told to exit: the job was given up


@dataclass
class Rejoin:
    """What a re-entered script's register() loads: ``source`` is {"record": own state} or the
    address to receive the donor's state on (a lagging survivor takes the donor's); ``own`` is kept
    until loading succeeded, so a torn donor stream leaves this rank able to try again."""

    source: dict[str, Any] | TransferAddress
    own: dict[str, Any]
    step: int
    gen: int = 0  # the generation whose collective failed
    donated_bytes: int = 0
    donated_seconds: float = 0.0


def is_interruption(exc: BaseException) -> bool:
    """True when ``exc`` left the script because a collective of the TorchPass group failed."""
    group = default_group.group()
    if group is None or isinstance(exc, KeyboardInterrupt):
        return False
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return False
    deadline = time.monotonic() + _GRACE
    while group.failed() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if group.failed() is None and not group.local and (broken := _broken_connection(exc)) is not None:
        group.failure = broken
    return group.failed() is not None


def _broken_connection(exc: BaseException) -> BaseException | None:
    """gloo's own error for a connection that broke under a collective (a peer lost), in ``exc``
    or what caused it. The group cannot learn it from the work: gloo's reduce-scatter works have
    no future, and after failing they say neither completed nor failed (measured on torch 2.13), so
    a peer lost during FSDP's reduce-scatter is known only from the error the script raised."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError) and _GLOO_TRANSPORT in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def interrupt(agent: Agent, exc: BaseException) -> Rejoin:
    """Capture this rank's state, tear the failed generation down, report INTERRUPTED and wait
    for launchpad's recover; returns what the re-entered script's register() must load."""
    group = default_group.group()
    assert group is not None  # is_interruption() said so
    gen, step, cause = group.gen, steps.current(), group.failed() or exc
    error = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:500]
    own: dict[str, Any] | None = None
    if agent.save_fn is not None:
        try:
            own = agent.capture(step)
        except Exception as save_exc:  # the user's save(): report it; no recovery then
            error += f"; save() failed: {save_exc!r}"
    traceback.clear_frames(exc.__traceback__)  # the failed run's frames hold its model and graph
    _tear_down(group)
    agent.drop_pause()
    agent.log.warning("agent.interrupted", gen=gen, step=step, registered=own is not None, error=error)
    return wait_for_recover(agent, own, step, gen, error)


def _tear_down(group: Any) -> None:
    """Close the failed generation's communicator (peers blocked on this rank fail now) and forget
    the process group and DDP instances of the failed run."""
    group.abandon()
    with contextlib.suppress(Exception):  # shutting the already abandoned group down is a no-op
        dist.destroy_process_group()
    default_group.forget()
    ddp_layout.forget()


def wait_for_recover(agent: Agent, own: dict[str, Any] | None, step: int, gen: int, error: str) -> Rejoin:
    """Report INTERRUPTED and carry out commands until a recover succeeds (returned) or exit. A
    failed recover (no register(), a donation that could not be delivered) is reported as an
    error, then as INTERRUPTED again: this rank keeps its state, the orchestrator may try again."""
    deadline = time.monotonic() + agent.timeouts.decision * 2
    report = True
    while True:
        if report:
            agent.send(ac.message(ac.INTERRUPTED, gen=gen, step=step, registered=own is not None, error=error))
            report = False
        msg = agent.command(deadline, "interrupted", "a recover",
                            hint="no orchestrator recovered the job; restart it from its last checkpoint")
        kind = msg["t"]
        if kind == ac.EXIT:  # the job is given up: end as failed (the agent is recovering)
            agent.exit()
        if kind != ac.RECOVER:
            agent.error(f"{kind} received while interrupted; only recover and exit are valid then")
            report = True
            continue
        if own is None:
            agent.error("cannot recover: the script never called torchpass.register(save=..., load=...), "
                         "so this rank has no state to donate or reload; restart from the last checkpoint")
            report = True
            continue
        load_from = None
        if msg.get("load_from"):
            try:
                load_from = handover.address(msg["load_from"], "recover's 'load_from'", rank=agent.rank,
                                             hint="launchpad and torchpass disagree on the agent channel")
            except WorkerError as exc:  # checked before donating: a refused command changes nothing
                agent.error(f"recover refused: {exc}; this rank keeps its state, send recover again")
                error, report = f"recover refused: {exc.message}", True
                continue
        try:
            sent, seconds = donate(own, msg["donate"], rank=agent.rank, wait=agent.timeouts.reform)
        except Exception as exc:  # any failure: report, keep the state, wait again
            agent.error(f"donating this rank's state (step {step}) failed: {exc}; it keeps its state, "
                         "send recover again")
            error, report = f"donation failed: {exc}", True
            continue
        source = load_from or {"record": own}
        agent.log.info("agent.recovering", gen=msg["gen"], step=step, load_from=repr(load_from) if load_from else "own",
                        donated=[d.get("to") for d in msg["donate"]], bytes=sent)
        return Rejoin(source, own, step, gen, sent, seconds)


def donate(own: dict[str, Any], donations: list[dict[str, Any]], *, rank: int, wait: float) -> tuple[int, float]:
    """Send ``own`` to each donation's ``dest`` (a wormhole receiver that may still be starting:
    wait up to ``wait`` s for it to listen); returns (bytes, seconds)."""
    t0, total = time.perf_counter(), 0
    dests = []
    for d in donations:  # every destination checked before the first byte is sent
        dest = d.get("dest") if isinstance(d, dict) else None
        if not isinstance(dest, dict):
            raise WorkerError(f"a donation needs a 'dest' map, got {d!r}", rank=rank)
        dests.append(handover.address(dest, "a donation's 'dest'", rank=rank,
                                      hint="launchpad and torchpass disagree on the agent channel"))
    for dest in dests:
        _wait_listening(dest.host, dest.port, wait, rank)
        total += handover.send(own, dest, rank=rank)
    return total, time.perf_counter() - t0


def _wait_listening(host: str, port: int, timeout: float, rank: int) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise WorkerError(f"no receiver listens at {host}:{port} after {timeout:.0f} s ({exc})",
                                  hint="the joining rank did not reach register()", rank=rank) from exc
        time.sleep(_POLL)

