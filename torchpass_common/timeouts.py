"""Every timeout TorchPass uses, in one place, with the check that they nest:
collective < step < re-form < orchestrator decision. A hierarchy that does not nest makes the
wrong layer give up first (a re-form declared failed while a collective is still waiting)."""

from __future__ import annotations

from dataclasses import dataclass

from torchpass_common.errors import ConfigError


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``collective``: one gloo/NCCL collective; ``step``: one training step may take
    this long before its rank is called hung; ``reform``: forming a new generation of the
    communicator; ``decision``: the orchestrator gives up on a migration phase and rolls back."""

    collective: float = 30.0
    step: float = 60.0
    reform: float = 120.0
    decision: float = 300.0
    heartbeat_interval: float = 1.0
    heartbeat_missed: int = 5

    def validate(self) -> Timeouts:
        """Raise ConfigError naming the first pair that does not nest."""
        chain = [("collective", self.collective), ("step", self.step),
                 ("reform", self.reform), ("decision", self.decision)]
        for name, value in chain:
            if value <= 0:
                raise ConfigError(f"timeouts.{name} must be positive, got {value}",
                                  hint="set it in the [timeouts] section of torchpass.toml")
        for (lo_name, lo), (hi_name, hi) in zip(chain, chain[1:], strict=False):
            if not lo < hi:
                raise ConfigError(
                    f"timeouts.{lo_name} ({lo} s) must be shorter than timeouts.{hi_name} ({hi} s)",
                    hint="timeouts must nest: collective < step < reform < decision")
        if self.heartbeat_interval <= 0 or self.heartbeat_missed < 1:
            raise ConfigError("timeouts.heartbeat_interval must be > 0 and heartbeat_missed >= 1")
        if self.heartbeat_dead_after >= self.decision:
            raise ConfigError(
                f"heartbeat loss detection ({self.heartbeat_interval} s x {self.heartbeat_missed}) "
                f"must be shorter than timeouts.decision ({self.decision} s)")
        return self

    @property
    def heartbeat_dead_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as lost."""
        return self.heartbeat_interval * self.heartbeat_missed
