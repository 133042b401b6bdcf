"""Replica rank sets as a heartbeat carries them: a few [start, stop, step] progressions that expand
back exactly, whatever the layout; a malformed one from the wire is a ProtocolError naming it."""

from __future__ import annotations

import random

import pytest

from torchpass_common import rank_ranges
from torchpass_common.errors import ProtocolError


@pytest.mark.parametrize(("ranks", "ranges"), [
    (list(range(1152)), [[0, 1152, 1]]),  # DDP: every rank
    (list(range(5, 1152, 8)), [[5, 1150, 8]]),  # HSDP, 8 ranks a node: the same shard on every node
    ([3], [[3, 4, 1]]),  # FSDP: no replica
    ([0, 1, 2, 7, 9, 11], [[0, 3, 1], [7, 12, 2]]),
])
def test_common_layouts_are_a_few_integers(ranks: list[int], ranges: list[list[int]]) -> None:
    assert rank_ranges.compact(ranks) == ranges
    assert rank_ranges.expand(ranges) == ranks


def test_any_set_round_trips() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ranks = sorted(rng.sample(range(500), rng.randint(1, 60)))
        assert rank_ranges.expand(rank_ranges.compact(ranks)) == ranks


@pytest.mark.parametrize("bad", [None, "0-3", [[0, 3]], [[3, 1, 1]], [[0, 4, 0]], [[-1, 2, 1]], [[0, 1 << 30, 1]],
                                 [[0, True, 1]]])
def test_a_malformed_set_is_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="replica ranks"):
        rank_ranges.expand(bad)
