"""How a transfer is cut into chunks and striped over the parallel streams. Sender and receiver
both derive the same plan from the leaf sizes in the manifest, so the wire carries no routing:
each chunk header only confirms what the receiver already expects."""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """``length`` bytes of leaf ``item`` starting at ``offset``."""

    item: int
    offset: int
    length: int


def stripe(sizes: list[int], streams: int, chunk_bytes: int) -> list[list[Chunk]]:
    """Cut every leaf into chunks of at most ``chunk_bytes`` and give each chunk, in order, to the
    stream with the fewest bytes so far (ties: lowest index). Returns one chunk list per stream."""
    if streams < 1 or chunk_bytes < 1:
        raise ValueError("streams and chunk_bytes must be positive")
    plan: list[list[Chunk]] = [[] for _ in range(streams)]
    load = [(0, s) for s in range(streams)]
    for item, size in enumerate(sizes):
        for offset in range(0, size, chunk_bytes):
            length = min(chunk_bytes, size - offset)
            done, s = heapq.heappop(load)
            plan[s].append(Chunk(item, offset, length))
            heapq.heappush(load, (done + length, s))
    return plan
