"""Where a rank that reached its pause step parks: when the next iteration starts, so that the
script's own work after ``opt.step()`` (scheduler, its step variable, logging, a loss all-reduce)
belongs to the finished step on every rank, the joiner included. The next iteration starts with
the first of: a pipeline schedule's next ``step()`` (pipeline_schedules: a later stage's first
forward waits on an earlier stage's send, so a stage must not park at its forward), DDP's next
forward (a script with DDP), or else the next forward of any module (FSDP2, tensor parallel, a
plain module). The agent owns the pause itself; this module only places the hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.nn.modules.module import register_module_forward_pre_hook

from torchpass import ddp_layout, pipeline_schedules


class Hook(Protocol):
    def remove(self) -> None: ...


def arm(park: Callable[[], None]) -> list[Hook]:
    """Hooks that call ``park`` once where the next iteration starts, removing them all first;
    pass them to disarm() to withdraw them unfired."""
    hooks: list[Hook] = []

    def fire() -> None:
        disarm(hooks)
        park()

    def before_forward(_module: Any, _inputs: Any) -> None:
        fire()

    if (next_step := pipeline_schedules.before_next_step(fire)) is not None:
        hooks.append(next_step)  # before any of the stages' forwards
    ddps = ddp_layout.live()
    if ddps:
        hooks.extend(d.register_forward_pre_hook(before_forward) for d in ddps)
    else:
        hooks.append(register_module_forward_pre_hook(before_forward))
    return hooks


def disarm(hooks: list[Hook]) -> None:
    for hook in hooks:
        hook.remove()
