"""Turning Slurm's OpenAPI JSON (what ``sinfo --json`` / ``squeue --json`` print and what
slurmrestd serves: v0.0.38 on 22.05, v0.0.41+ on 24.11) into model records. Both the command
and the REST backends parse through here, so they agree on every field by construction."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from slurm_plugin import hostlist
from slurm_plugin.model import Job, Node, Reservation


def _number(value: Any) -> int:
    """v0.0.38 gives plain integers; v0.0.40+ wraps them as {"set": bool, "number": n}."""
    if isinstance(value, Mapping):
        return int(value.get("number") or 0) if value.get("set", True) else 0
    return int(value or 0)


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _node_state(raw: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    """Base state (lower case) and flags; v0.0.41 puts both into one list ["IDLE", "DRAIN"]."""
    state = raw.get("state", "unknown")
    flags = {str(f).upper() for f in raw.get("state_flags") or ()}
    if isinstance(state, list):
        base, *rest = [str(s).upper() for s in state] or ["UNKNOWN"]
        flags.update(rest)
        state = base
    state = str(state).lower()
    if state == "idle" and _number(raw.get("alloc_cpus")) > 0:
        state = "mixed"  # v0.0.41 reports a partly allocated node as IDLE+MIXED; keep one word
    if "MIXED" in flags:
        flags.discard("MIXED")
        state = "mixed"
    return state, frozenset(flags)


def node(raw: Mapping[str, Any]) -> Node:
    state, flags = _node_state(raw)
    return Node(
        name=_text(raw.get("name")),
        state=state,
        flags=flags,
        reason=_text(raw.get("reason")),
        reason_by=_text(raw.get("reason_set_by_user")),
        reason_time=_number(raw.get("reason_changed_at")),
        addr=_text(raw.get("address")),
    )


def _job_state(value: Any) -> str:
    if isinstance(value, list):
        return str(value[0]).upper() if value else "UNKNOWN"
    return _text(value).upper()


def job(raw: Mapping[str, Any]) -> Job:
    return Job(
        job_id=_number(raw.get("job_id")),
        name=_text(raw.get("name")),
        user=_text(raw.get("user_name")),
        state=_job_state(raw.get("job_state")),
        nodes=tuple(hostlist.expand(_text(raw.get("nodes")))),
        batch_host=_text(raw.get("batch_host")),
        partition=_text(raw.get("partition")),
        comment=_text(raw.get("comment")),
        admin_comment=_text(raw.get("admin_comment")),
        resize_time=_number(raw.get("resize_time")),
        start_time=_number(raw.get("start_time")),
    )


def reservation(raw: Mapping[str, Any], now: float | None = None) -> Reservation:
    now = time.time() if now is None else now
    start, end = _number(raw.get("start_time")), _number(raw.get("end_time"))
    return Reservation(
        name=_text(raw.get("name")),
        nodes=tuple(hostlist.expand(_text(raw.get("node_list")))),
        state="ACTIVE" if start <= now and (end == 0 or now < end) else "INACTIVE",
        users=_names(raw.get("users")),
    )


def _names(value: Any) -> tuple[str, ...]:
    """A user list: "root,alice" (v0.0.38) or ["root", "alice"]."""
    items = value if isinstance(value, list) else _text(value).split(",")
    return tuple(str(v).strip() for v in items if str(v).strip())


def nodes(doc: Mapping[str, Any]) -> dict[str, Node]:
    return {n.name: n for n in map(node, _items(doc, "nodes"))}


def jobs(doc: Mapping[str, Any]) -> dict[int, Job]:
    return {j.job_id: j for j in map(job, _items(doc, "jobs"))}


def reservations(doc: Mapping[str, Any]) -> dict[str, Reservation]:
    return {r.name: r for r in map(reservation, _items(doc, "reservations"))}


def _items(doc: Mapping[str, Any], key: str) -> Iterable[Mapping[str, Any]]:
    return doc.get(key) or ()


def errors(doc: Mapping[str, Any]) -> list[str]:
    """The ``errors`` array of a response, as Slurm's messages (empty when all is well)."""
    out = []
    for err in doc.get("errors") or ():
        if isinstance(err, Mapping):
            out.append(_text(err.get("error") or err.get("description") or err))
        else:
            out.append(_text(err))
    return [e for e in out if e]
