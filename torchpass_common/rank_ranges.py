"""A set of ranks as a few arithmetic progressions, [[start, stop, step], ...] (Python range
arguments), so that a heartbeat can say which ranks hold a replica of a worker's state in a few
integers however large the job: every rank of a 1,152-rank DDP job is [[0, 1152, 1]], the HSDP
replicas of rank 5 with 8 ranks a node are [[5, 1150, 8]]."""

from __future__ import annotations

from typing import Any

from torchpass_common.errors import ProtocolError

MAX_RANK = 1 << 24  # far beyond any job; bounds what a malformed message can make us build


def compact(ranks: list[int]) -> list[list[int]]:
    """Sorted distinct ``ranks`` as progressions (greedy: each takes as many as keep its step)."""
    out: list[list[int]] = []
    todo = sorted(set(ranks))
    i = 0
    while i < len(todo):
        if i + 1 == len(todo):
            out.append([todo[i], todo[i] + 1, 1])
            break
        step, j = todo[i + 1] - todo[i], i + 1
        while j + 1 < len(todo) and todo[j + 1] - todo[j] == step:
            j += 1
        out.append([todo[i], todo[j] + 1, step])
        i = j + 1
    return out


def span(ranks: list[int]) -> str:
    """Ranks for people to read: [0, 1, 2, 3, 6] -> "0-3, 6"."""
    parts: list[str] = []
    for r in sorted(set(ranks)):
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ", ".join(parts)


def expand(ranges: Any) -> list[int]:
    """The ranks ``ranges`` (as ``compact`` made them) stand for; ProtocolError if malformed."""
    if not isinstance(ranges, list):
        raise ProtocolError(f"replica ranks must be a list of [start, stop, step], got {ranges!r}")
    ranks: set[int] = set()
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 0 <= r[0] < r[1] <= MAX_RANK and r[2] > 0):
            raise ProtocolError(f"replica ranks: {r!r} is not [start, stop, step] with 0 <= start < stop and step > 0")
        ranks.update(range(*r))
    return sorted(ranks)
