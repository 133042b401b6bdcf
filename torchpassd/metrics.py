"""torchpassd's Prometheus metrics: the TorchPass metric set and an asyncio HTTP endpoint serving
it at /metrics. The metric types and the exposition (text format 0.0.4, or OpenMetrics when the
scraper asks for it) are prometheus-client's; this module owns the metric names, their labels,
the label-checking calls the orchestrator uses (``inc(mode=..., outcome=...)``) and the endpoint.
Process metrics (CPU, memory, open files) come with every scrape. What the values mean is decided
by the code that updates them (the orchestrator)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Self

import prometheus_client
from prometheus_client import exposition

from torchpass_common import log

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# A ``*_created`` series per counter and histogram would double the scrape for a value no dashboard reads.
prometheus_client.disable_created_metrics()


class _Family:
    """One prometheus-client metric of torchpassd's registry, updated with its labels as keywords."""

    def __init__(self, registry: prometheus_client.CollectorRegistry,
                 metric: prometheus_client.metrics.MetricWrapperBase, name: str, labelnames: tuple[str, ...]) -> None:
        self._registry, self._metric, self.name, self.labelnames = registry, metric, name, labelnames

    def _child(self, labels: dict[str, str]) -> Any:  # prometheus-client's labelled child
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return self._metric.labels(**{n: str(v) for n, v in labels.items()}) if self.labelnames else self._metric


class Counter(_Family):
    """A monotonically increasing count, per label combination."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, name: str, help_text: str,
                 labelnames: tuple[str, ...] = ()) -> None:
        metric = prometheus_client.Counter(name, help_text, labelnames, registry=registry)
        super().__init__(registry, metric, name, labelnames)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def value(self, **labels: str) -> float:
        """The count so far for ``labels`` (0 when never counted)."""
        self._child(labels)  # checks the names
        return self._registry.get_sample_value(self.name, {n: str(v) for n, v in labels.items()}) or 0.0


class Gauge(_Family):
    """A value that goes up and down, per label combination."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, name: str, help_text: str,
                 labelnames: tuple[str, ...] = ()) -> None:
        metric = prometheus_client.Gauge(name, help_text, labelnames, registry=registry)
        super().__init__(registry, metric, name, labelnames)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def remove(self, **labels: str) -> None:
        self._child(labels)  # checks the names
        with contextlib.suppress(KeyError):
            self._metric.remove(*(str(labels[n]) for n in self.labelnames))


class Histogram(_Family):
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, name: str, help_text: str,
                 buckets: tuple[float, ...], labelnames: tuple[str, ...] = ()) -> None:
        metric = prometheus_client.Histogram(name, help_text, labelnames, registry=registry, buckets=buckets)
        super().__init__(registry, metric, name, labelnames)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


class Metrics:
    """The metrics torchpassd exports. Update the attributes; :meth:`render` is the scrape."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        prometheus_client.ProcessCollector(registry=self.registry)
        r = self.registry
        self.migrations_total = Counter(
            r, "torchpass_migrations_total", "Migrations finished, by mode and outcome.", ("mode", "outcome"))
        self.migration_pause_seconds = Histogram(
            r, "torchpass_migration_pause_seconds",
            "Training pause of a migration: last step before it to first step after it.", PAUSE_BUCKETS)
        self.failure_detect_seconds = Histogram(
            r, "torchpass_failure_detect_seconds",
            "Unplanned migration: first sign of a node's failure to torchpassd's decision.", PAUSE_BUCKETS)
        self.spares_free = Gauge(r, "torchpass_spares_free", "Spare nodes free to take a migration.")
        self.jobs_tracked = Gauge(r, "torchpass_jobs_tracked", "Slurm jobs running under TorchPass.")
        self.health_decisions_total = Counter(
            r, "torchpass_health_decisions_total", "GPU health decisions about nodes, by signal and action.",
            ("signal", "action"))
        self.heartbeat_age_seconds = Gauge(
            r, "torchpass_heartbeat_age_seconds", "Seconds since the last heartbeat of a node's launchpad.",
            ("job", "node"))
        self.reports_refused_total = Counter(
            r, "torchpass_reports_refused_total",
            "Launchpad reports torchpassd did not act on: about a node Slurm does not show in the sender's job, "
            "over the rate limit, or too many waiting for Slurm's confirmation.", ("reason",))
        self.credentials_refused_total = Counter(
            r, "torchpass_credentials_refused_total",
            "Requests for a job's broker account refused: over the rate, malformed, or a proof that does not hold.",
            ("reason",))
        self.stragglers_total = Counter(
            r, "torchpass_stragglers_total",
            "Nodes migrated as stragglers: their ranks wanted [straggler] ratio x the CPU a step of the job's others.")
        self._last_heartbeat: dict[tuple[str, str], float] = {}
        self.spares_free.set(0)
        self.jobs_tracked.set(0)

    def heartbeat_seen(self, job: str, node: str) -> None:
        self._last_heartbeat[(job, node)] = time.monotonic()

    def forget_node(self, job: str, node: str) -> None:
        """Stop exporting a node's heartbeat age (it left the job, or the job ended)."""
        self._last_heartbeat.pop((job, node), None)
        self.heartbeat_age_seconds.remove(job=job, node=node)

    def _refresh_ages(self) -> None:
        now = time.monotonic()
        for (job, node), seen in self._last_heartbeat.items():
            self.heartbeat_age_seconds.set(round(now - seen, 3), job=job, node=node)

    def render(self) -> str:
        """The scrape in the text format 0.0.4."""
        return self.scrape("")[0].decode()

    def scrape(self, accept: str) -> tuple[bytes, str]:
        """The exposition the scraper's ``Accept`` header asks for (OpenMetrics, else text 0.0.4) and its type."""
        self._refresh_ages()
        encoder, content_type = exposition.choose_encoder(accept)
        if not content_type.startswith("application/openmetrics-text"):
            encoder, content_type = prometheus_client.generate_latest, CONTENT_TYPE
        return encoder(self.registry), content_type


class MetricsServer:
    """Serves ``metrics.scrape()`` over HTTP at /metrics while entered; ``port`` 0 picks one."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 9464) -> None:
        self.metrics, self.host, self.port = metrics, host, port
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=8192)
        self.port = self._server.sockets[0].getsockname()[1]
        log.get().info("metrics.listening", host=self.host, port=self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            request, *headers = head.decode("latin-1").split("\r\n")
            method, path, *_ = request.split(" ") + ["", ""]
            accept = next((v.strip() for k, _, v in (h.partition(":") for h in headers) if k.lower() == "accept"), "")
            if method != "GET":
                status, data, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif path.split("?")[0] == "/metrics":
                data, ctype = self.metrics.scrape(accept)
                status = "200 OK"
            else:
                status, data, ctype = "404 Not Found", b"metrics are at /metrics\n", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that hung up or sent garbage gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
