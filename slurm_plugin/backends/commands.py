"""The command backend: reads slurmctld with ``sinfo --json``, ``squeue --json`` (22.05 has no
``scontrol --json``; both ignore filters, so each is one full dump) and ``scontrol -o show res``.
Works on every Slurm release that has the JSON output (21.08+); no daemon or token needed."""

from __future__ import annotations

import json
import re
from typing import Any

from slurm_plugin import hostlist, openapi
from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job, Node, Reservation
from slurm_plugin.runner import SlurmRunner
from torchpass_common.errors import SlurmError

_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_oneliner(line: str) -> dict[str, str]:
    """One ``scontrol -o`` record (``Key=value Key=value with spaces ...``) as a dict."""
    keys = list(_KEY.finditer(line))
    out = {}
    for m, nxt in zip(keys, [*keys[1:], None], strict=True):
        out[m.group(1)] = line[m.end():nxt.start() if nxt else len(line)].strip()
    return out


class CommandClient(SlurmClient):
    name = "commands"

    def __init__(self, runner: SlurmRunner) -> None:
        self.runner = runner

    def _json(self, argv: list[str]) -> dict[str, Any]:
        out = self.runner.run(argv)
        try:
            doc = json.loads(out)
        except ValueError as exc:
            raise SlurmError(f"`{' '.join(argv)}` printed something that is not JSON: {out[:200]!r}",
                             hint="this Slurm may be older than 21.08 (no --json)") from exc
        errs = openapi.errors(doc)
        if errs:
            raise SlurmError(f"`{' '.join(argv)}` reported: {'; '.join(errs)}")
        return doc

    def nodes(self) -> dict[str, Node]:
        return openapi.nodes(self._json(["sinfo", "--json"]))

    def jobs(self) -> dict[int, Job]:
        return openapi.jobs(self._json(["squeue", "--json"]))

    def reservations(self) -> dict[str, Reservation]:
        out = {}
        for line in self.runner.run(["scontrol", "-o", "show", "reservation"]).splitlines():
            rec = parse_oneliner(line)
            if "ReservationName" in rec:
                nodes = rec.get("Nodes", "")
                out[rec["ReservationName"]] = Reservation(
                    name=rec["ReservationName"],
                    nodes=tuple(hostlist.expand(nodes if nodes != "(null)" else "")),
                    state=rec.get("State", ""),
                    users=tuple(u for u in rec.get("Users", "").split(",") if u and u != "(null)"),
                )
        return out
