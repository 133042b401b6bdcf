"""The step counter: completed optimizer steps in this process, counted by a global optimizer
step post-hook, or torchpass.step() calls once a script makes one (then optimizer steps stop
counting, which is what a loop with several optimizers needs). At each step boundary it calls
one callback; what happens there (report, park) is the agent client's business."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from torchpass import layout

_count = 0
_manual = False
_boundary: Callable[[int], None] | None = None
_hook: Any = None


def install() -> None:
    """Register the global optimizer step post-hook (once per process)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_on_optimizer_step)


def _on_optimizer_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    layout.saw_optimizer(optimizer)  # what it trains tells which ranks hold replicas
    if not _manual:
        _advance()


def step() -> int:
    """Mark a step boundary by hand; from the first call on, optimizer steps no longer count."""
    global _manual
    _manual = True
    return _advance()


def _advance() -> int:
    global _count
    _count += 1
    if _boundary is not None:
        _boundary(_count)
    return _count


def current() -> int:
    """Completed steps so far."""
    return _count


def restore(count: int) -> None:
    """Set the counter, e.g. to the donor's step on a joining rank."""
    global _count
    _count = count


def boundary() -> Callable[[int], None] | None:
    """The callback on_boundary() installed, if any."""
    return _boundary


def on_boundary(callback: Callable[[int], None] | None) -> None:
    """Call ``callback(step)`` after every completed step (None removes it)."""
    global _boundary
    _boundary = callback
