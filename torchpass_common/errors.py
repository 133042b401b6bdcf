"""The project's exception types. Every error an operator or user can hit is one of these,
with a message that says what failed, where (job, node, rank, generation) and what to do."""

from __future__ import annotations


class TorchPassError(Exception):
    """Base of all TorchPass errors.

    ``where`` names the place (job, node, rank, gen, migration) and ``hint`` what to do next;
    both are folded into ``str(err)`` so a log line or a CLI message carries them.
    """

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


class ConfigError(TorchPassError):
    """The configuration file or an override is missing, unreadable or invalid."""


class SlurmError(TorchPassError):
    """Slurm refused or failed an operation; carries Slurm's own message."""


class ProtocolError(TorchPassError):
    """A control-plane message was malformed, too large, of an unknown kind or version."""


class WormholeError(TorchPassError):
    """A state transfer failed: authentication, a torn stream, a checksum mismatch."""


class MigrationError(TorchPassError):
    """A migration could not proceed; the job was left running (rolled back)."""


class SpareFailed(MigrationError):
    """The spare a migration took could not take over the ranks (its joiner did not start, or did
    not get ready): torchpassd drains ``spare`` with this reason instead of using it again."""

    def __init__(self, message: str, *, spare: str, hint: str | None = None, **where: object) -> None:
        super().__init__(message, hint=hint, **where)
        self.spare = spare


class CannotMove(MigrationError):
    """A move that would fail the same way if tried again (criu cannot restore this process): the
    orchestrator gives the move up instead of retrying it. Its ack says so (``lasting``)."""


class WorkerError(TorchPassError):
    """A worker process misbehaved: it died, hung, or its save/load functions raised."""
