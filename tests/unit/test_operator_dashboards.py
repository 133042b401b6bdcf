"""The operators' Grafana dashboard (contrib/grafana/torchpass.json) and Prometheus alert rules
(contrib/prometheus/alerts.yml) ask only for metrics and labels torchpassd exports, with label
values it uses: a renamed metric or label breaks this test, not an operator's dashboard at 3 am."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from torchpassd.metrics import Histogram, Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "torchpass.json"
ALERTS = ROOT / "contrib" / "prometheus" / "alerts.yml"
# label values torchpassd writes (torchpassd/planned.py, unplanned.py, transparent.py, report_gate.py,
# job_credentials.py); a query filtering on another value would never match
VALUES = {"outcome": {"succeeded", "failed", "rolled_back"},
          "reason": {"not_in_job", "job_not_running", "rate", "held_overflow", "request", "proof"}}
SELECTOR = re.compile(r"(torchpass_[a-z_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")


def exported() -> dict[str, tuple[str, ...]]:
    """Each series name torchpassd exports -> its label names (a histogram's le included)."""
    out: dict[str, tuple[str, ...]] = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, Histogram):
            out |= {metric.name + "_bucket": (*metric.labelnames, "le"), metric.name + "_sum": metric.labelnames,
                    metric.name + "_count": metric.labelnames}
        elif hasattr(metric, "labelnames"):
            out[metric.name] = metric.labelnames
    return out


def check_expr(expr: str, where: str) -> set[str]:
    """Assert every series and label ``expr`` uses exists; returns the labels its result may keep."""
    series = exported()
    found = SELECTOR.findall(expr)
    assert found, f"{where}: no TorchPass metric in {expr!r}"
    labels: set[str] = set()
    for name, matchers in found:
        assert name in series, f"{where}: torchpassd exports no {name} ({expr!r})"
        labels |= set(series[name])
        for label, op, value in MATCHER.findall(matchers):
            assert label in series[name], f"{where}: {name} has no label {label}"
            if label in VALUES:
                wanted = set(value.split("|")) if op in ("=~", "!~") else {value}
                assert wanted <= VALUES[label], f"{where}: {label} is never {wanted - VALUES[label]}"
    for group in GROUPING.findall(expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            assert label in labels, f"{where}: grouping by {label}, which {', '.join(n for n, _ in found)} lack"
    return labels


def test_dashboard_panels_query_what_torchpassd_exports_and_fit_the_grid() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "TorchPass" and dash["uid"] and dash["panels"]
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource"}
    ids, cells = [p["id"] for p in dash["panels"]], set()
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            kept = check_expr(t["expr"], f"panel {p['title']!r}")
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                assert label in kept, f"panel {p['title']!r} shows {label}, which its query drops"
    covered = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in ("torchpass_migrations_total", "torchpass_migration_pause_seconds_bucket", "torchpass_spares_free",
                 "torchpass_health_decisions_total", "torchpass_heartbeat_age_seconds"):
        assert name in covered, f"the dashboard shows nothing of {name}"


def test_alert_rules_are_well_formed_and_use_exported_metrics() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules) >= 6
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        if r["expr"].startswith("up{"):
            continue  # Prometheus' own scrape health of torchpassd
        kept = check_expr(r["expr"], f"alert {r['alert']}")
        text = r["annotations"]["summary"] + r["annotations"]["description"]
        for label in re.findall(r"\$labels\.(\w+)", text):
            assert label in kept, f"alert {r['alert']} names {label}, which its expression drops"


PROMTOOL = Path("/opt/torchpass/prometheus/promtool")  # contrib/install/install-promtool.sh (make setup)


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool") or (str(PROMTOOL) if PROMTOOL.exists() else None)
    if promtool is None:
        pytest.skip("promtool is not installed (make setup: contrib/install/install-promtool.sh)")
    res = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
