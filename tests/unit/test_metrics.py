"""torchpassd's Prometheus endpoint scraped over real HTTP: names with units, labels, histogram
buckets, heartbeat ages that grow between scrapes, and a well-formed text exposition."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.error
import urllib.request

import pytest

from torchpassd.metrics import CONTENT_TYPE, Metrics, MetricsServer

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>([a-zA-Z_]\w*="([^"\\]|\\.)*",?)*)\})? '
                    r'(?P<value>[-+]?(\d+(\.\d*)?([eE][-+]?\d+)?|Inf|NaN))$')


def scrape(metrics: Metrics, path: str = "/metrics", accept: str = "") -> tuple[int, str, str]:
    def get(port: int) -> tuple[int, str, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Accept": accept} if accept else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.headers["Content-Type"], resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()

    async def main() -> tuple[int, str, str]:
        async with MetricsServer(metrics, "127.0.0.1", 0) as server:
            return await asyncio.wait_for(asyncio.to_thread(get, server.port), 20)
    return asyncio.run(main())


def parse(text: str) -> dict[str, float]:
    """Check every line of the exposition; return {'name{labels}': value}."""
    samples, typed = {}, set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            if line.startswith("# TYPE "):
                typed.add(line.split()[2])
            continue
        m = SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        assert re.sub(r"_(bucket|sum|count)$", "", m["name"]) in typed, f"sample before its TYPE: {line}"
        samples[line.rsplit(" ", 1)[0]] = float(m["value"].replace("Inf", "inf"))
    return samples


def test_scrape_exposes_the_torchpass_metrics() -> None:
    m = Metrics()
    m.migrations_total.inc(mode="planned-aware", outcome="succeeded")
    m.migrations_total.inc(mode="planned-aware", outcome="succeeded")
    m.migrations_total.inc(mode="unplanned-aware", outcome="rolled_back")
    for pause in (0.04, 0.3, 7.0):
        m.migration_pause_seconds.observe(pause)
    m.spares_free.set(1)
    m.jobs_tracked.set(3)
    m.heartbeat_seen("12", "n1")

    status, ctype, text = scrape(m)
    assert (status, ctype) == (200, CONTENT_TYPE)
    s = parse(text)
    assert s['torchpass_migrations_total{mode="planned-aware",outcome="succeeded"}'] == 2
    assert s['torchpass_migrations_total{mode="unplanned-aware",outcome="rolled_back"}'] == 1
    assert s['torchpass_migration_pause_seconds_bucket{le="0.05"}'] == 1
    assert s['torchpass_migration_pause_seconds_bucket{le="0.5"}'] == 2
    assert s['torchpass_migration_pause_seconds_bucket{le="+Inf"}'] == 3
    assert s["torchpass_migration_pause_seconds_count"] == 3
    assert s["torchpass_migration_pause_seconds_sum"] == pytest.approx(7.34)
    assert (s["torchpass_spares_free"], s["torchpass_jobs_tracked"]) == (1, 3)
    assert 0 <= s['torchpass_heartbeat_age_seconds{job="12",node="n1"}'] < 5
    assert "# TYPE torchpass_migration_pause_seconds histogram" in text


def test_heartbeat_age_grows_and_a_forgotten_node_disappears() -> None:
    m = Metrics()
    m.heartbeat_seen("12", "n1")
    m.heartbeat_seen("12", "n2")
    time.sleep(0.05)
    age = parse(scrape(m)[2])['torchpass_heartbeat_age_seconds{job="12",node="n1"}']
    assert age >= 0.05
    m.heartbeat_seen("12", "n1")
    m.forget_node("12", "n2")
    s = parse(scrape(m)[2])
    assert s['torchpass_heartbeat_age_seconds{job="12",node="n1"}'] < age
    assert not any("n2" in k for k in s)


def test_label_values_are_escaped_and_label_names_enforced() -> None:
    m = Metrics()
    m.heartbeat_seen('a"b\\c', "n\n1")
    s = parse(m.render())
    assert 'torchpass_heartbeat_age_seconds{job="a\\"b\\\\c",node="n\\n1"}' in s
    with pytest.raises(ValueError, match="takes labels"):
        m.migrations_total.inc(mode="x")


def test_a_scraper_asking_for_openmetrics_gets_it_and_process_metrics_come_with_every_scrape() -> None:
    m = Metrics()
    m.migrations_total.inc(mode="planned-aware", outcome="succeeded")
    status, ctype, text = scrape(m, accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert status == 200 and ctype.startswith("application/openmetrics-text"), ctype
    assert text.endswith("# EOF\n")
    assert 'torchpass_migrations_total{mode="planned-aware",outcome="succeeded"} 1.0' in text
    plain = parse(scrape(m)[2])
    assert plain["process_cpu_seconds_total"] > 0 and plain["process_resident_memory_bytes"] > 0
    assert not any(k.endswith("_created") or "_created{" in k for k in plain), "no _created series"


def test_other_paths_are_not_found() -> None:
    status, _, body = scrape(Metrics(), "/")
    assert status == 404 and "/metrics" in body
