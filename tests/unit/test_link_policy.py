"""torchpassd's link policy: a node whose fabric link is down reroutes the job's collectives over
the fallback (no rank moves); back on the fabric after the hold-down; a flapping link keeps the
job on the fallback (damped); a node with neither path has its ranks migrated; a job on its own
interface is left alone. The rule (``decide``) and the watch that keeps each node's link history
from heartbeats, whose launchpads count every carrier change."""

from __future__ import annotations

from typing import Any

import pytest

from torchpass_common.config import LinksConfig
from torchpass_common.errors import ConfigError
from torchpassd.link_policy import MIGRATE, REROUTE, RETURN, Decision, LinkHistory, PathWatch, decide
from torchpassd.registry import JobView, Launchpad

CFG = LinksConfig(fabric="eth1", fallback="eth0", hold_down=10.0, flap_transitions=3, flap_window=60.0)


def up(since: float = 0.0) -> LinkHistory:
    return LinkHistory(True, since)


def down(since: float = 0.0) -> LinkHistory:
    return LinkHistory(False, since)


def links(**up_: bool) -> dict[str, LinkHistory]:
    """Fallback links, each up or down since time 0."""
    return {n: LinkHistory(u, 0.0) for n, u in up_.items()}


def test_a_fabric_link_down_reroutes_the_job_over_the_fallback() -> None:
    got = decide("7", "eth1", {"n1": up(), "n2": down(), "n3": up()}, links(n1=True, n2=True, n3=True), CFG, 5.0)
    assert [(d.action, d.node, d.ifname) for d in got] == [(REROUTE, "n2", "eth0")]
    assert "eth1 down on n2" in got[0].reason
    assert decide("7", "eth1", {"n1": up(), "n2": up()}, links(n1=True, n2=True), CFG, 5.0) == []


def test_a_node_with_neither_path_has_its_ranks_migrated_once_it_stays_so_for_the_hold_down() -> None:
    fabric = {"n1": up(), "n2": down()}
    assert decide("7", "eth1", fabric, links(n1=True, n2=False), CFG, 1.0) == []  # a blip, or a late heartbeat
    assert [(d.action, d.node) for d in decide("7", "eth1", fabric, links(n1=True, n2=False), CFG, 10.0)] == \
        [(MIGRATE, "n2")]
    no_fallback = LinksConfig(fabric="eth1", hold_down=10.0)
    got = decide("7", "eth1", fabric, {}, no_fallback, 12.0)
    assert [(d.action, d.node) for d in got] == [(MIGRATE, "n2")] and "eth1 down on n2 for 12 s" in got[0].reason
    # on the fallback already, and the fallback goes too: migrated once it has been down the hold-down
    late = {"n1": LinkHistory(True, 0.0), "n2": LinkHistory(False, 95.0)}
    assert decide("7", "eth0", fabric, late, CFG, 100.0) == []
    assert [d.action for d in decide("7", "eth0", fabric, late, CFG, 105.0)] == [MIGRATE]


def test_back_on_the_fabric_once_every_link_was_up_for_the_hold_down() -> None:
    fallback = links(n1=True, n2=True)
    assert decide("7", "eth0", {"n1": up(0.0), "n2": up(95.0)}, fallback, CFG, 100.0) == []  # n2 up 5 s only
    got = decide("7", "eth0", {"n1": up(0.0), "n2": up(95.0)}, fallback, CFG, 105.0)
    assert [(d.action, d.ifname) for d in got] == [(RETURN, "eth1")]
    assert decide("7", "eth0", {"n1": up(0.0), "n2": down(95.0)}, fallback, CFG, 500.0) == []  # still down


def test_a_failing_fallback_returns_to_a_fabric_that_is_back_without_waiting() -> None:
    got = decide("7", "eth0", {"n1": up(99.0), "n2": up(99.0)}, links(n1=True, n2=False), CFG, 100.0)
    assert [(d.action, d.ifname) for d in got] == [(RETURN, "eth1")]


def test_a_flapping_link_keeps_the_job_on_the_fallback_until_it_is_quiet() -> None:
    hist = LinkHistory(True, 0.0)
    for t in range(1, 31):  # a change a second for 30 s
        hist.seen(t % 2 == 0, t, float(t), CFG.flap_window)
    assert hist.flapping(CFG, 40.0)
    fabric = {"n1": up(0.0), "n2": hist}
    assert decide("7", "eth0", fabric, links(n1=True, n2=True), CFG, 45.0) == []  # up 15 s, but flapping: damped
    assert not hist.flapping(CFG, 91.0)  # the window passed without a change
    assert [d.action for d in decide("7", "eth0", fabric, links(n1=True, n2=True), CFG, 91.0)] == [RETURN]


def test_changes_between_two_heartbeats_count_from_launchpads_counter() -> None:
    hist = LinkHistory(True, 0.0, counted=0)
    hist.seen(True, 4, 10.0, 60.0)  # down and up twice between two heartbeats: still up, 4 changes
    assert hist.up and len(hist.changes) == 4 and hist.since == 10.0 and hist.flapping(CFG, 10.0)
    hist.seen(False, 0, 11.0, 60.0)  # a launchpad restarted (counter reset): the state change counts once
    assert len(hist.changes) == 5 and not hist.up


def test_jobs_off_torchpass_paths_are_left_alone() -> None:
    fabric, fallback = {"n1": down()}, links(n1=True)
    assert decide("7", "ib0", fabric, fallback, CFG, 1.0) == []  # the job chose its own interface
    assert decide("7", "", fabric, fallback, CFG, 1.0) == []  # no path reported
    assert decide("7", "eth1", fabric, fallback, LinksConfig(), 1.0) == []  # no fabric configured


def test_links_config_is_checked() -> None:
    for bad in ({"fallback": "eth0"}, {"fabric": "eth1", "fallback": "eth1"},
                {"fabric": "eth1", "flap_transitions": 1}, {"fabric": "eth1", "hold_down": -1.0}):
        with pytest.raises(ConfigError):
            LinksConfig(**bad).validate()


def heartbeat(carrier: bool, changes: int, fallback: bool = True) -> dict[str, Any]:
    return {"workers": [{"rank": 0}], "links": {"eth1": {"carrier": carrier, "changes": changes},
                                                "eth0": {"carrier": fallback, "changes": 0}}}


def watched(nodes: tuple[str, ...], path: str = "eth1") -> tuple[JobView, list[Decision], list[float], PathWatch]:
    """Job 7 training on ``nodes`` (one rank each, collectives on ``path``), the watch judging it on
    a clock the test sets (``now[0]``), and the decisions it made."""
    view = JobView("7", user="u", nodes=nodes)
    for n in nodes:
        view.launchpads[n] = Launchpad(n, online=True, workers=[{"rank": 0}], path=path)
    decisions: list[Decision] = []
    now = [0.0]
    return view, decisions, now, PathWatch(CFG, lambda job: view, decisions.append, clock=lambda: now[0])


def test_the_watch_reroutes_from_heartbeats_and_only_judges_nodes_running_the_job() -> None:
    view, decisions, now, watch = watched(("n1", "n2", "n3"))
    for n in ("n1", "n2", "n3"):
        watch.on_heartbeat("7", n, heartbeat(True, 0))
    assert decisions == []
    now[0] = 1.0
    watch.on_heartbeat("7", "n2", heartbeat(False, 1))
    assert [(d.action, d.node, d.ifname) for d in decisions] == [(REROUTE, "n2", "eth0")]
    decisions.clear()
    view.emptied.add("n2")  # n2's ranks moved away: its link no longer matters to the job
    watch.on_heartbeat("7", "n1", heartbeat(True, 0))
    assert decisions == []
    watch.on_heartbeat("7", "n2", {"workers": [], "links": "garbage"})  # malformed: ignored
    assert decisions == []


def test_a_late_heartbeat_from_a_short_partition_moves_nothing() -> None:
    """Found by the soak: a node cut off for 2.5 s (both paths down) heartbeats during the cut; TCP
    delivers that heartbeat once the cut healed, just before the fresh ones. It must not migrate the
    node; a node that really stays without a path is migrated once the hold-down passed."""
    _, decisions, now, watch = watched(("n1", "n2"))
    for n in ("n1", "n2"):
        watch.on_heartbeat("7", n, heartbeat(True, 0))
    now[0] = 30.0
    watch.on_heartbeat("7", "n2", heartbeat(False, 1, fallback=False))  # sent during the cut, arrives late
    now[0] = 30.05
    watch.on_heartbeat("7", "n2", heartbeat(True, 2))  # the fresh one: both back
    now[0] = 45.0
    watch.on_heartbeat("7", "n1", heartbeat(True, 0))
    assert decisions == []
    for t in (50.0, 55.0, 60.5):  # n2 without a path from 50 s on, still heartbeating (another network)
        now[0] = t
        watch.on_heartbeat("7", "n2", heartbeat(False, 3, fallback=False))
    assert [(d.action, d.node) for d in decisions] == [(MIGRATE, "n2")]


def test_a_node_whose_ranks_stop_holds_every_decision_until_it_leaves_the_job() -> None:
    """Found by CI: the job ended while n2's fabric link was damped (flapping); n2's launchpad left
    first, and judging the three others alone returned the job to the fabric mid-flap, as it
    ended. Nothing is decided until n2 is back or out of the job."""
    view, decisions, now, watch = watched(("n1", "n2", "n3"), path="eth0")
    for n in ("n1", "n3"):
        watch.on_heartbeat("7", n, heartbeat(True, 0))
    for t, count in ((1.0, 1), (3.0, 3), (5.0, 5)):  # flapping, now up
        now[0] = t
        watch.on_heartbeat("7", "n2", heartbeat(True, count))
    now[0] = 20.0
    watch.on_heartbeat("7", "n1", heartbeat(True, 0))
    assert decisions == [], "damped: stays on the fallback"
    view.launchpads["n2"].online, view.launchpads["n2"].workers = False, []  # its ranks ended, its launchpad left
    watch.on_heartbeat("7", "n1", heartbeat(True, 0))
    assert decisions == [], "decided without n2's flapping link"
    view.nodes = ("n1", "n3")  # n2 out of the job (a recovery replaced it): the others are judged alone
    watch.on_heartbeat("7", "n1", heartbeat(True, 0))
    assert [(d.action, d.ifname) for d in decisions] == [(RETURN, "eth1")]
