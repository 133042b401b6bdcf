"""pytest plugin: the fault matrix of issue 11. Fault tests record their cell with
``fault_matrix.case(fault, during)`` (fixture ``fault_matrix``); at the end of the run the matrix
(every fault x situation, with outcome, detail and seconds) is printed as a table and, when any
cell ran, written to fault-matrix.txt in the e2e directory it was given."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAULTS = ("kill -9 torchpassd", "kill -9 broker", "kill -9 one launchpad", "network cut of one node",
          "a survivor killed", "a second node drained", "broker stopped 60 s", "joining spare killed")
DURING = ("idle training", "planned migration", "unplanned recovery", "transparent migration")
OK = "job running, nothing lost"


class FaultMatrix:
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], dict[str, Any]] = {}
        self.out: Path | None = None

    @contextlib.contextmanager
    def case(self, fault: str, during: str) -> Iterator[dict[str, Any]]:
        """Record one cell; set ``cell["outcome"]`` (OK or a clear, reported failure) and
        ``cell["detail"]``. An exception marks the cell TEST FAILED with the error."""
        assert fault in FAULTS and during.startswith(DURING), (fault, during)  # e.g. "... migration (paused)"
        cell: dict[str, Any] = {"outcome": "TEST FAILED", "detail": ""}
        self.cells[(fault, during)] = cell
        t0 = time.monotonic()
        try:
            yield cell
        except BaseException as exc:
            cell["outcome"], cell["detail"] = "TEST FAILED", f"{type(exc).__name__}: {str(exc)[:150]}"
            raise
        finally:
            cell["seconds"] = round(time.monotonic() - t0, 1)

    def table(self) -> str:
        rows = [("fault", "during", "outcome", "seconds", "detail")]
        keys = [(f, d) for f in FAULTS for d in DURING]
        keys += sorted(k for k in self.cells if k not in keys)  # a situation named more closely ("... (phase)")
        for fault, during in keys:
            c = self.cells.get((fault, during))
            rows.append((fault, during, c["outcome"], str(c.get("seconds", "")), c["detail"]) if c
                        else (fault, during, "not run", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r[:4], widths, strict=False)) + "  " + r[4] for r in rows]
        return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


MATRIX = FaultMatrix()


@pytest.fixture
def fault_matrix() -> FaultMatrix:
    return MATRIX


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MATRIX.cells:
        return
    terminalreporter.section("fault matrix (issue 11)")
    table = MATRIX.table()
    terminalreporter.write_line(table)
    if MATRIX.out is not None:
        MATRIX.out.write_text(table + "\n")
