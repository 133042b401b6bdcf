"""Suite-wide pytest set-up: the project root on sys.path and the rule that a test needing
hardware this machine lacks is skipped with the reason, never silently."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.support.broker", "tests.support.devcluster", "tests.support.fault_matrix"]
