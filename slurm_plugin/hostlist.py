"""Slurm hostlist expressions (``n[1-3,7],gpu05``): expand them into node names and compress
node names back. Pure string work, so the watcher never has to call ``scontrol show hostnames``."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torchpass_common.errors import SlurmError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TAIL_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _split_top(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SlurmError(f"unbalanced brackets in hostlist {expr!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(item: str, whole: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, body, rest = item[:start], item[start + 1:end], item[end + 1:]
    names = []
    for rng in body.split(","):
        m = _RANGE.match(rng)
        if not m:
            raise SlurmError(f"bad range {rng!r} in hostlist {whole!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)
        for i in range(int(lo), int(hi) + 1):
            names.extend(f"{prefix}{i:0{width}d}{tail}" for tail in _expand_one(rest, whole))
    return names


def expand(expr: str | None) -> list[str]:
    """``"n[1-3],x"`` -> ``["n1", "n2", "n3", "x"]``; empty or None -> ``[]``; order kept."""
    if not expr or expr in ("(null)", "None"):
        return []
    out: list[str] = []
    for item in _split_top(expr.strip()):
        out.extend(_expand_one(item, expr))
    return out


def compress(names: Iterable[str]) -> str:
    """``["n1", "n2", "n3", "x"]`` -> ``"n[1-3],x"`` (numeric suffixes of equal width grouped)."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in sorted(set(names)):
        m = _TAIL_NUMBER.match(name)
        if m:
            groups.setdefault((m.group(1), len(m.group(2))), []).append(int(m.group(2)))
        else:
            plain.append(name)
    out = list(plain)
    for (prefix, width), nums in sorted(groups.items()):
        if len(nums) == 1:
            out.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        spans, start, prev = [], nums[0], nums[0]
        for n in nums[1:]:
            if n != prev + 1:
                spans.append((start, prev))
                start = n
            prev = n
        spans.append((start, prev))
        text = ",".join(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in spans)
        out.append(f"{prefix}[{text}]")
    return ",".join(out)
