"""torchpassd's link policy (issue 24): which network path a job's collectives take, from the links
its launchpads report with their heartbeats. A node whose fabric link (``links.fabric``) lost its
carrier while the node itself is healthy (its launchpad still heartbeats over the management
network) reroutes the whole job over ``links.fallback``: every rank's collectives are cut and its
groups re-formed over the fallback, resuming at the step that failed; no rank moves (reroute.py). Back on the fabric once every node's fabric link
has been up ``hold_down`` seconds and none is flapping (``flap_transitions`` changes within
``flap_window`` seconds: damped, the job stays on the fallback). A node whose fallback is down too,
or a site without a fallback, has its ranks migrated like a drain once it has been without a path
for ``hold_down`` seconds: a heartbeat sent during a short partition can arrive after it healed
(TCP delivers it late), and a blip must not cost a spare. Jobs that chose their own interface
(GLOO_SOCKET_IFNAME in their environment) are left alone. While a node that ran the job's ranks has
stopped (its launchpad gone, the job ending or a node lost to a recovery) nothing is decided: its
link's history would be left out of the judgement.

The rule is a pure function (``decide``); ``PathWatch`` keeps each node's fabric history from the
heartbeats and hands decisions to the orchestrator. It moves nothing itself."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchpass_common import log
from torchpass_common.config import LinksConfig
from torchpassd.registry import JobView

REROUTE, RETURN, MIGRATE = "reroute", "return", "migrate"


@dataclass
class LinkHistory:
    """One node's link (its fabric or its fallback) as its heartbeats showed it: up or not, since
    when, and when it changed (launchpad counts every carrier change, so a flap between two
    heartbeats counts)."""

    up: bool
    since: float
    changes: deque[float] = field(default_factory=deque)
    counted: int = 0  # launchpad's change count at the last heartbeat

    def seen(self, up: bool, count: int, now: float, window: float) -> None:
        new = max(0, count - self.counted) or (1 if up != self.up else 0)
        self.changes.extend([now] * min(new, 64))
        if up != self.up or new:
            self.since = now
        self.up, self.counted = up, count
        while self.changes and self.changes[0] < now - window:
            self.changes.popleft()

    def flapping(self, cfg: LinksConfig, now: float) -> bool:
        return sum(1 for t in self.changes if t >= now - cfg.flap_window) >= cfg.flap_transitions


@dataclass(frozen=True)
class Decision:
    """``action`` for ``job``: REROUTE or RETURN its collectives to ``ifname``, or MIGRATE
    ``node``'s ranks; ``reason`` says why, in words for the history."""

    action: str
    job: str
    node: str
    ifname: str
    reason: str


def decide(job: str, path: str, fabric: Mapping[str, LinkHistory], fallback: Mapping[str, LinkHistory],
           cfg: LinksConfig, now: float) -> list[Decision]:
    """What the job whose collectives take ``path`` should do, given each node's fabric and
    fallback histories. Nothing for a job off TorchPass's paths."""
    if not cfg.fabric or not path or path not in (cfg.fabric, cfg.fallback) or not fabric:
        return []

    def fallback_up(n: str) -> bool:
        return bool(cfg.fallback) and n in fallback and fallback[n].up

    down = sorted(n for n, h in fabric.items() if not h.up)
    stranded = [n for n in down if not fallback_up(n)]
    if stranded:  # neither path: the node cannot take part in the job's collectives
        since = {n: max(fabric[n].since, fallback[n].since if n in fallback else fabric[n].since) for n in stranded}
        return [Decision(MIGRATE, job, n, "", f"{cfg.fabric}{' and ' + cfg.fallback if cfg.fallback else ''} "
                                               f"down on {n} for {now - since[n]:.0f} s: no path left for its "
                                               "collectives")
                for n in stranded if now - since[n] >= cfg.hold_down]  # none yet: wait, it may be a blip
    if path == cfg.fabric:
        return [Decision(REROUTE, job, down[0], cfg.fallback,
                         f"{cfg.fabric} down on {', '.join(down)}: collectives rerouted over {cfg.fallback}")] \
            if down else []
    if down:
        return []
    failing = sorted(n for n in fabric if not fallback_up(n))
    if failing:  # the fallback is failing where the fabric is back: no hold-down
        return [Decision(RETURN, job, failing[0], cfg.fabric,
                         f"{cfg.fallback} down on {', '.join(failing)} and {cfg.fabric} up everywhere: "
                         f"collectives back on {cfg.fabric}")]
    if any(h.flapping(cfg, now) for h in fabric.values()):
        return []  # damped: stay on the fallback until the link is quiet
    if all(now - h.since >= cfg.hold_down for h in fabric.values()):
        last = max(fabric, key=lambda n: fabric[n].since)  # the link whose return ends the reroute
        return [Decision(RETURN, job, last, cfg.fabric,
                         f"{cfg.fabric} up on every node for {cfg.hold_down:g} s: collectives back on it")]
    return []


Act = Callable[[Decision], None]


class PathWatch:
    """One per torchpassd; fed every heartbeat (``on_heartbeat``) after the registry took it;
    ``view(job)`` is the registry's view of the job (the path its collectives take now, the nodes
    whose launchpads run its ranks). ``act`` gets each decision (the orchestrator queues it;
    repeats are the orchestrator's to fold)."""

    def __init__(self, cfg: LinksConfig, view: Callable[[str], JobView], act: Act,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.view, self.act, self.clock = cfg, view, act, clock
        self._fabric: dict[str, dict[str, LinkHistory]] = {}  # job -> node -> its fabric link
        self._fallback: dict[str, dict[str, LinkHistory]] = {}  # job -> node -> its fallback link
        self._flapping: set[tuple[str, str]] = set()  # logged once per episode
        self._ranked: dict[str, set[str]] = {}  # job -> nodes seen running its ranks (until emptied or gone)
        self._log = log.get()

    def on_heartbeat(self, job: str, node: str, body: Mapping[str, Any]) -> None:
        if not self.cfg.fabric:
            return
        now = self.clock()
        links = body.get("links")
        if isinstance(links, dict):
            fab, back = links.get(self.cfg.fabric), links.get(self.cfg.fallback) if self.cfg.fallback else None
            if isinstance(fab, dict) and isinstance(fab.get("carrier"), bool):
                self._seen(self._fabric.setdefault(job, {}), node, fab["carrier"], fab.get("changes"), now)
            if isinstance(back, dict):
                self._seen(self._fallback.setdefault(job, {}), node, back.get("carrier") is True,
                           back.get("changes"), now)
        self._judge(job, now)

    def _seen(self, links: dict[str, LinkHistory], node: str, up: bool, changes: Any, now: float) -> None:
        count = changes if isinstance(changes, int) and not isinstance(changes, bool) else 0
        hist = links.get(node)
        if hist is None:
            links[node] = LinkHistory(up, now, counted=count)
        else:
            hist.seen(up, count, now, self.cfg.flap_window)

    def _judge(self, job: str, now: float) -> None:
        view = self.view(job)
        training = {n for n, lp in view.launchpads.items() if lp.online and lp.workers and n not in view.emptied}
        fabric = {n: h for n, h in self._fabric.get(job, {}).items() if n in training}
        ranked = self._ranked.setdefault(job, set())
        ranked |= training
        ranked -= {n for n in ranked if n in view.emptied or (view.nodes and n not in view.nodes)}
        for node, hist in fabric.items():
            key, flapping = (job, node), hist.flapping(self.cfg, now)
            if flapping and key not in self._flapping:
                self._log.warning("links.flapping", job=job, node=node, link=self.cfg.fabric,
                                  changes=len(hist.changes), window_s=self.cfg.flap_window,
                                  effect="the job stays on the fallback until the link is quiet")
            (self._flapping.add if flapping else self._flapping.discard)(key)
        if ranked - training:  # judging without it would forget its link (a flapping one: a return mid-flap)
            return  # a node of the job stopped running ranks: the job is ending or a recovery is the answer
        for decision in decide(job, view.path, fabric, self._fallback.get(job, {}), self.cfg, now):
            self.act(decision)

    def job_ended(self, job: str) -> None:
        self._fabric.pop(job, None)
        self._fallback.pop(job, None)
        self._ranked.pop(job, None)
        self._flapping = {k for k in self._flapping if k[0] != job}
