"""CRIU and CUDA-checkpoint errors. All are MigrationErrors: when one is raised before a worker was
killed, the migration is abandoned and the worker goes on where it is (the caller resumes it)."""

from __future__ import annotations

from torchpass_common.errors import MigrationError


class CriuUnavailable(MigrationError):
    """No usable criu (4.2 or newer, passing `criu check`) was found; says why for each candidate."""


class CriuFailed(MigrationError):
    """A criu dump or restore failed or timed out; carries criu's own error lines and its log path."""


class CudaCheckpointUnsupported(MigrationError):
    """The CUDA driver cannot checkpoint this process (no driver, driver < 570, MIG, UVM)."""


class CudaCheckpointFailed(MigrationError):
    """A CUDA driver checkpoint call (lock, checkpoint, restore, unlock) returned an error."""
