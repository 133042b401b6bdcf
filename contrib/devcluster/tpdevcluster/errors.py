"""The dev cluster's one exception type. It mirrors torchpass_common.errors (what failed,
where, what to do) without importing it, because this tool must run before the venv exists."""

from __future__ import annotations


class DevClusterError(Exception):
    """A dev cluster operation failed; ``where`` names the instance/node/daemon, ``hint`` the fix."""

    def __init__(self, message: str, *, hint: str | None = None, **where: object) -> None:
        self.message = message
        self.hint = hint
        self.where = {k: v for k, v in where.items() if v is not None}
        parts = [message]
        if self.where:
            parts.append("(" + ", ".join(f"{k}={v}" for k, v in self.where.items()) + ")")
        if hint:
            parts.append(f"- {hint}")
        super().__init__(" ".join(parts))
