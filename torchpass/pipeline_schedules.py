"""The pipeline schedules (``torch.distributed.pipelining``) of this process, as a pause and a
re-formation need them. A schedule's ``step()`` is one optimizer step's worth of micro-batches whose
stages wait on each other's send/recv inside it, so a pipeline rank cannot park at its next module
forward (a later stage's first forward waits on a recv from an earlier stage that parked): it parks
on entering ``step()``, where every rank of the pipeline has finished the previous step's P2P
traffic and started none of the next. A schedule initialises its stages on its first step (a P2P
warm-up vote and, without static shapes, a metadata exchange along the pipeline group); a joining
rank's fresh schedule does that on its first step, so every schedule that ran in an earlier
generation of the TorchPass group initialises again on its first step of a new one, with it.

Nothing is wrapped until a pause is armed in a process that has loaded torch's pipelining module
(importing it costs more than a second, so TorchPass never does): other jobs are untouched."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torchpass import default_group
from torchpass_common import log

SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"
# A schedule's "stages initialised" flags (torch 2.13's PipelineScheduleSingle and PipelineScheduleMulti,
# and the single flag of older releases): cleared, the next step() runs the stages' initialisation again.
_INIT_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized",
               "_stages_forward_initialized", "_stages_backward_initialized",
               "_stage_initialized", "_stages_initialized")

_ran_in: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # schedule -> last generation
_before_step: list[Callable[[], None]] = []  # one-shot callbacks for the next step() entry


class NextStep:
    """A callback waiting for the next schedule ``step()``; ``remove()`` withdraws it."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def remove(self) -> None:
        if self.callback in _before_step:
            _before_step.remove(self.callback)


def before_next_step(callback: Callable[[], None]) -> NextStep | None:
    """Call ``callback`` (once) when the next schedule ``step()`` starts, before any of its
    micro-batches; None when this process runs no pipeline schedule (nothing to wait for)."""
    if not _wrap():
        return None
    _before_step.append(callback)
    return NextStep(callback)


def _wrap() -> bool:
    module = sys.modules.get(SCHEDULES_MODULE)
    if module is None:
        return False
    pending = [module._PipelineSchedule]
    while pending:  # torch's schedules and the script's own subclasses, whichever defines step()
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        step = vars(cls).get("step")
        if step is not None and not getattr(step, "__isabstractmethod__", False) \
                and not getattr(step, "_torchpass", False):
            cls.step = _wrapped(step)
    return True


def _wrapped(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(schedule: Any, *args: Any, **kwargs: Any) -> Any:
        before = _ran_in.get(schedule, _generation())
        while _before_step:  # a pause parks here (and re-forms while parked)
            _before_step.pop(0)()
        now = _generation()
        if before != now:
            _uninitialise(schedule, before, now)
        _ran_in[schedule] = now
        return step(schedule, *args, **kwargs)

    run._torchpass = True  # type: ignore[attr-defined]
    return run


def _generation() -> int:
    group = default_group.group()
    return group.gen if group is not None else 0


def _rank() -> int:
    group = default_group.group()
    return group.rank() if group is not None else -1


def _uninitialise(schedule: Any, before: int, now: int) -> None:
    cleared = [flag for flag in _INIT_FLAGS if getattr(schedule, flag, False)]
    for flag in cleared:
        setattr(schedule, flag, False)
    log.get(rank=_rank(), gen=now).info("pipeline.reinitialise", schedule=type(schedule).__name__, was_gen=before,
                          flags=cleared)
