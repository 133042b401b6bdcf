"""Fixtures shared by the unit tests that drive real worker processes over the agent channel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agent_driver import EXAMPLE, Driver


@pytest.fixture
def drivers(tmp_path: Path) -> Iterator[Callable[..., Driver]]:
    """Makes Drivers (of ``script``, by default the DDP example) under the test's temporary
    directory; stops every process they started."""
    made: list[Driver] = []

    def make(name: str, world_size: int, args: list[str], script: Path = EXAMPLE) -> Driver:
        sub = tmp_path / name
        sub.mkdir()
        made.append(Driver(sub, world_size, args, script))
        return made[-1]

    yield make
    for d in made:
        d.close()
