"""The dev cluster's one exception type, a TorchPassError (what failed, where, what to do).
torchpass_common.errors uses only the standard library, so this tool still runs before any venv
exists; the repository root is put on sys.path for it."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[3])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torchpass_common.errors import TorchPassError  # noqa: E402


class DevClusterError(TorchPassError):
    """A dev cluster operation failed; ``where`` names the instance/node/daemon, ``hint`` the fix."""
