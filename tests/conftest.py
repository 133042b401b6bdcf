"""Suite-wide pytest set-up: the project root on sys.path, the rule that a test needing
hardware this machine lacks is skipped with the reason, never silently, and the long markers
(matrix, soak, fuzz) that run only when ``-m`` names them (make test-matrix), not in CI."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.support.broker", "tests.support.devcluster", "tests.support.e2e", "tests.support.fault_matrix"]

LONG = ("matrix", "soak", "fuzz")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Leave out tests marked matrix/soak/fuzz unless the -m expression asks for one of them."""
    wanted = config.getoption("markexpr") or ""
    if any(m in wanted for m in LONG):
        return
    keep = [i for i in items if not any(i.get_closest_marker(m) for m in LONG)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
