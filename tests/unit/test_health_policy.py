"""The GPU health policy on recorded sequences replayed through the fake NVML and the heartbeat
encoding: a degrading GPU is acted on at the right sample with a reason naming the signal, never
before; a stable or slowly warming GPU never is. Also each signal, the latch, operator config,
and HealthWatch journaling its decisions in a real journal."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from launchpad.telemetry.collector import Collector
from launchpad.telemetry.encoding import DeltaDecoder, DeltaEncoder
from launchpad.telemetry.replay import ReplayBackend
from torchpass_common import config
from torchpass_common.config import HealthConfig
from torchpass_common.errors import ConfigError, SlurmError
from torchpassd.health_policy import Decision, HealthPolicy
from torchpassd.health_watch import HealthWatch
from torchpassd.journal import Journal
from torchpassd.metrics import Metrics

HEALTH = Path(__file__).resolve().parents[2] / "torchpassd" / "drill_jobs" / "health"


def replay(name: str, cfg: HealthConfig, samples: int = 40) -> list[Decision | None]:
    """One decision (or None) per replayed sample, as torchpassd would see them."""
    collector = Collector(ReplayBackend.from_file(HEALTH / name, start=0.0), node="n3")
    assert collector.open()
    enc, dec, policy = DeltaEncoder(), DeltaDecoder(), HealthPolicy(cfg)
    return [policy.observe("42", "n3", dec.apply(enc.encode(collector.sample()))) for _ in range(samples)]


def first(decisions: list[Decision | None]) -> tuple[int, Decision]:
    fired = [(i, d) for i, d in enumerate(decisions) if d is not None]
    assert len(fired) == 1, f"expected exactly one decision, got {fired}"
    return fired[0]


def test_a_degrading_gpu_is_drained_at_the_xid_not_before() -> None:
    step, d = first(replay("degrading.json", HealthConfig(), samples=20))
    assert step == 12  # corrected ECC climbs from step 6 (below the burst limit), XID 79 at step 12
    assert (d.action, d.signal, d.node, d.job, d.gpu) == ("drain", "xid", "n3", "42", "0")
    assert d.reason == "torchpass: GPU0 XID 79 (fell off the bus)"
    assert d.at == 60.0 and d.evidence["uuid"].startswith("GPU-7f1c0000")
    assert d.evidence["fields"]["ecc_vol_corr"] == 340 and d.evidence["fields"]["xid_79"] == 1
    assert step < 14  # the GPU is lost ("the failure") at step 14


def test_a_tighter_burst_limit_acts_on_the_climbing_corrected_ecc_earlier() -> None:
    step, d = first(replay("degrading.json", HealthConfig(corrected_ecc_burst=100), samples=20))
    assert (step, d.signal) == (10, "ecc_burst")
    assert d.reason == "torchpass: GPU0 130 corrected ECC errors in 600 s"


def test_a_gpu_that_stops_answering_is_acted_on_at_once() -> None:
    step, d = first(replay("degrading.json", HealthConfig(fatal_xids=[]), samples=20))
    assert (step, d.signal) == (14, "not_answering")
    assert d.reason == "torchpass: GPU0 not answering (ecc_volatile: GPU is lost (replayed))"


@pytest.mark.parametrize("name", ["stable.json", "warming.json"])
def test_no_false_positive_on_a_stable_or_slowly_warming_gpu(name: str) -> None:
    assert replay(name, HealthConfig()) == [None] * 40


def test_temperature_counts_only_when_held_above_the_limit() -> None:
    step, d = first(replay("warming.json", HealthConfig(temperature_for=5.0)))
    assert (step, d.signal) == (21, "temperature")  # 91 C at steps 20 and 21 (5 s apart)
    assert d.reason == "torchpass: GPU0 91 C for 5 s (limit 90 C)"


@pytest.mark.parametrize("action", ["migrate", "none"])
def test_the_configured_action_is_carried(action: str) -> None:
    _, d = first(replay("degrading.json", HealthConfig(action=action), samples=20))
    assert d.action == action


def gpu(**fields: Any) -> dict[str, Any]:
    return {"uuid": "GPU-x", "name": "A100", "answering": True, "temp_c": 50, "ecc_vol_corr": 0, "ecc_vol_unc": 0,
            **fields}


def test_uncorrectable_ecc_and_pending_remapping_are_signals() -> None:
    policy = HealthPolicy(HealthConfig())
    d = policy.observe("1", "a", {"t": 0.0, "gpus": {"0": gpu(), "3": gpu(ecc_vol_unc=2, remap_pending=True)}})
    assert d is not None and (d.gpu, d.signal) == ("3", "ecc_uncorrected")
    assert [s["signal"] for s in d.evidence["signals"]] == ["ecc_uncorrected", "retirement"]
    d = HealthPolicy(HealthConfig()).observe("1", "b", {"t": 0.0, "gpus": {"0": gpu(remap_failed=True)}})
    assert d is not None and d.reason == "torchpass: GPU0 row remapping failed (needs a GPU reset)"
    assert HealthPolicy(HealthConfig(pending_retirement=False)).observe(
        "1", "b", {"t": 0.0, "gpus": {"0": gpu(remap_failed=True)}}) is None


def test_nvlink_error_growth_is_a_signal_and_old_counts_are_not() -> None:
    policy = HealthPolicy(HealthConfig(nvlink_error_burst=100, rate_window=60.0))
    seq = [(0.0, 5000), (30.0, 5040), (90.0, 5090), (120.0, 5195)]  # 5000 errors from long ago
    out = [policy.observe("1", "a", {"t": t, "gpus": {"0": gpu(nvlink_crc_flit=n)}}) for t, n in seq]
    assert out[:3] == [None, None, None]
    assert out[3] is not None and out[3].reason == "torchpass: GPU0 105 NVLink errors in 60 s"


def test_a_node_is_decided_once_until_it_returns_then_only_new_errors_count() -> None:
    policy = HealthPolicy(HealthConfig())
    bad = {"t": 0.0, "gpus": {"0": gpu(xid_79=1, xid_last=79)}}
    assert policy.observe("1", "a", bad) is not None
    assert policy.observe("1", "a", {**bad, "t": 5.0}) is None
    policy.clear("a")  # the operator resumed the node
    assert policy.observe("1", "a", {**bad, "t": 10.0}) is None
    again = policy.observe("1", "a", {"t": 15.0, "gpus": {"0": gpu(xid_79=1, xid_48=1, xid_last=48)}})
    assert again is not None and again.reason == "torchpass: GPU0 XID 48 (double-bit ECC error)"


def test_health_config_is_validated() -> None:
    cfg = config.parse('[health]\naction = "migrate"\nfatal_xids = [79, 123]\ntemperature_limit = 85\n')
    assert (cfg.health.action, cfg.health.fatal_xids, cfg.health.temperature_limit) == ("migrate", [79, 123], 85.0)
    with pytest.raises(ConfigError, match="health.action must be drain, migrate or none"):
        config.parse('[health]\naction = "reboot"\n')
    with pytest.raises(ConfigError, match="health.fatal_xids must be a list of XID numbers"):
        config.parse('[health]\nfatal_xids = ["79"]\n')
    with pytest.raises(ConfigError, match="health.corrected_ecc_burst must be at least 1"):
        config.parse('[health]\ncorrected_ecc_burst = 0\n')


def test_health_watch_drains_once_and_journals_the_evidence(tmp_path: Path) -> None:
    drained: list[tuple[str, str]] = []

    async def drain(node: str, reason: str) -> None:
        drained.append((node, reason))
        if len(drained) > 1:
            raise SlurmError("scontrol refused", node=node)

    async def main() -> None:
        metrics = Metrics()
        with Journal(tmp_path / "journal.sqlite") as journal:
            watch = HealthWatch(HealthConfig(), journal, drain=drain, migrate=lambda *a: None,
                                counter=metrics.health_decisions_total)
            collector = Collector(ReplayBackend.from_file(HEALTH / "degrading.json", start=0.0), node="n3")
            collector.open()
            enc = DeltaEncoder()
            decisions = [await watch.on_heartbeat("42", "n3", {"gpu": enc.encode(collector.sample())})
                         for _ in range(16)]
            assert await watch.on_heartbeat("42", "n3", {"workers": []}) is None  # no telemetry in it
            assert await watch.on_heartbeat("42", "n3", {"gpu": {"s": "x"}}) is None  # logged, dropped
            odd = {"s": 1, "t": 0.0, "n": "nvml", "g": {"0": {"temp_c": "hot"}}}
            assert await watch.on_heartbeat("42", "n9", {"gpu": odd}) is None
            await watch.settle()
            assert [i for i, d in enumerate(decisions) if d] == [12]
            assert drained == [("n3", "torchpass: GPU0 XID 79 (fell off the bus)")]
            (event,) = journal.events(job_id="42")
            assert event.event == "health.decision" and event.detail["signal"] == "xid"
            assert event.detail["evidence"]["fields"]["xid_79"] == 1 and "failed" not in event.detail
            assert metrics.health_decisions_total.value(signal="xid", action="drain") == 1
            view = (await watch.op_health({}))["n3"]
            assert view["decision"]["reason"] == drained[0][1]
            assert view["gpus"]["0"]["state"] == "not answering" and view["gpus"]["1"]["state"] == "ok"
            assert view["summary"] == "GPU0 not answering"

            watch.node_returned("n3")  # resumed while GPU0 is still lost: drained again, the refusal journaled
            d = await watch.on_heartbeat("42", "n3", {"gpu": enc.encode(collector.sample())})
            assert d is not None and d.signal == "not_answering"
            await watch.settle()
            assert "scontrol refused" in journal.events(job_id="42")[-1].detail["failed"]
    asyncio.run(main())


def test_health_watch_summarises_each_node_for_operators(tmp_path: Path) -> None:
    async def main() -> None:
        with Journal(tmp_path / "journal.sqlite") as journal:
            watch = HealthWatch(HealthConfig(), journal, drain=None, migrate=lambda *a: None,  # type: ignore[arg-type]
                                counter=Metrics().health_decisions_total)
            collector = Collector(ReplayBackend.from_file(HEALTH / "stable.json", start=0.0), node="n1")
            collector.open()
            enc = DeltaEncoder()
            for _ in range(4):
                assert await watch.on_heartbeat("7", "n1", {"gpu": enc.encode(collector.sample())}) is None
            no_gpu = Collector(ReplayBackend({"nvml": "absent", "steps": [{}]}), node="n2")
            no_gpu.open()
            await watch.on_heartbeat("7", "n2", {"gpu": DeltaEncoder().encode(no_gpu.sample())})
            broken = {"s": 1, "t": 0.0, "n": "failed", "w": "nvmlInit: Unknown Error", "g": {}}
            await watch.on_heartbeat("7", "n3", {"gpu": broken})
            seen = watch.policy.latest["n1"]["t"]
            watch.job_ended("7")  # its streams are forgotten (a delta no longer applies); node health stays
            assert await watch.on_heartbeat("7", "n1", {"gpu": enc.encode(collector.sample())}) is None
            assert watch.policy.latest["n1"]["t"] == seen
            view = watch.describe()
            assert view["n3"]["summary"] == "NVML failed: nvmlInit: Unknown Error"
            assert view["n1"]["summary"] == "ok (2 GPUs, max 66 C)" and view["n1"]["decision"] is None
            assert view["n2"]["summary"] == "no NVML" and view["n2"]["gpus"] == {}
    asyncio.run(main())
