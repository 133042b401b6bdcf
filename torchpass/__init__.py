"""torchpass: the worker-side library, the only TorchPass code imported into training scripts.
``torchpass.register(save=..., load=...)`` is the model-aware hook; ``torchpass.step()`` marks a
step boundary in loops without a torch optimizer. Under plain torchrun both are harmless."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchpass import runtime, steps

__all__ = ["current_step", "register", "step"]

steps.install()


def register(*, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
    """Give TorchPass this rank's state functions. ``save()`` returns everything needed to continue
    (model, optimizer, scheduler, data position, RNG, step); ``load(state)`` restores it. Call it
    where a checkpoint would be loaded: after the model, optimizer and DDP/FSDP are built, right
    before the training loop. On a joining rank it loads the migrated state before returning."""
    runtime.register(save, load)


def step() -> int:
    """Mark the end of a training step by hand; returns the number of completed steps."""
    return steps.step()


def current_step() -> int:
    """Completed steps in this process (optimizer steps, or torchpass.step() calls)."""
    return steps.current()
