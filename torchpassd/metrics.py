"""torchpassd's Prometheus metrics: the metric types it needs (counter, gauge, histogram with
labels), the TorchPass metric set, and an asyncio HTTP endpoint serving the text exposition
format (version 0.0.4) at /metrics. No client library: the format is small and stable.
What the values mean is decided by the code that updates them (the orchestrator)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Self

from torchpass_common import log

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _labels(self, key: LabelValues, extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labelnames, key, strict=True), *extra]
        return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in pairs) + "}" if pairs else ""

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        return "\n".join([f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()])


class _ValueMetric(_Metric):
    """One number per label combination."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}

    def samples(self) -> list[str]:
        return [f"{self.name}{self._labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Counter(_ValueMetric):
    """A monotonically increasing count, per label combination."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} can only go up, got {amount}")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(_ValueMetric):
    """A value that goes up and down, per label combination."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def remove(self, **labels: str) -> None:
        self.values.pop(self._key(labels), None)


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = (*sorted(buckets), math.inf)
        self.counts: dict[LabelValues, list[int]] = {}
        self.sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self.counts.setdefault(key, [0] * len(self.buckets))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value

    def samples(self) -> list[str]:
        lines = []
        for key, counts in sorted(self.counts.items()):
            for bound, count in zip(self.buckets, counts, strict=True):
                lines.append(f"{self.name}_bucket{self._labels(key, (('le', _number(bound)),))} {count}")
            lines.append(f"{self.name}_sum{self._labels(key)} {_number(self.sums[key])}")
            lines.append(f"{self.name}_count{self._labels(key)} {counts[-1]}")
        return lines


class Metrics:
    """The metrics torchpassd exports. Update the attributes; :meth:`render` is the scrape."""

    def __init__(self) -> None:
        self.migrations_total = Counter(
            "torchpass_migrations_total", "Migrations finished, by mode and outcome.", ("mode", "outcome"))
        self.migration_pause_seconds = Histogram(
            "torchpass_migration_pause_seconds",
            "Training pause of a migration: last step before it to first step after it.", PAUSE_BUCKETS)
        self.failure_detect_seconds = Histogram(
            "torchpass_failure_detect_seconds",
            "Unplanned migration: first sign of a node's failure to torchpassd's decision.", PAUSE_BUCKETS)
        self.spares_free = Gauge("torchpass_spares_free", "Spare nodes free to take a migration.")
        self.jobs_tracked = Gauge("torchpass_jobs_tracked", "Slurm jobs running under TorchPass.")
        self.health_decisions_total = Counter(
            "torchpass_health_decisions_total", "GPU health decisions about nodes, by signal and action.",
            ("signal", "action"))
        self.heartbeat_age_seconds = Gauge(
            "torchpass_heartbeat_age_seconds", "Seconds since the last heartbeat of a node's launchpad.",
            ("job", "node"))
        self.reports_refused_total = Counter(
            "torchpass_reports_refused_total",
            "Launchpad reports torchpassd did not act on: about a node Slurm does not show in the sender's job, "
            "over the rate limit, or too many waiting for Slurm's confirmation.", ("reason",))
        self.credentials_refused_total = Counter(
            "torchpass_credentials_refused_total",
            "Requests for a job's broker account refused: over the rate, malformed, or a proof that does not hold.",
            ("reason",))
        self._last_heartbeat: dict[tuple[str, str], float] = {}
        self.spares_free.set(0)
        self.jobs_tracked.set(0)

    def heartbeat_seen(self, job: str, node: str) -> None:
        self._last_heartbeat[(job, node)] = time.monotonic()

    def forget_node(self, job: str, node: str) -> None:
        """Stop exporting a node's heartbeat age (it left the job, or the job ended)."""
        self._last_heartbeat.pop((job, node), None)
        self.heartbeat_age_seconds.remove(job=job, node=node)

    def render(self) -> str:
        now = time.monotonic()
        for (job, node), seen in self._last_heartbeat.items():
            self.heartbeat_age_seconds.set(round(now - seen, 3), job=job, node=node)
        metrics = (self.migrations_total, self.migration_pause_seconds, self.failure_detect_seconds,
                   self.spares_free, self.jobs_tracked, self.heartbeat_age_seconds, self.health_decisions_total,
                   self.reports_refused_total, self.credentials_refused_total)
        return "\n".join(m.render() for m in metrics) + "\n"


class MetricsServer:
    """Serves ``metrics.render()`` over HTTP at /metrics while entered; ``port`` 0 picks one."""

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
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
            if method != "GET":
                status, body, ctype = "405 Method Not Allowed", "only GET\n", "text/plain"
            elif path.split("?")[0] == "/metrics":
                status, body, ctype = "200 OK", self.metrics.render(), CONTENT_TYPE
            else:
                status, body, ctype = "404 Not Found", "metrics are at /metrics\n", "text/plain"
            data = body.encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that hung up or sent garbage gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
