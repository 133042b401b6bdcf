"""GPU telemetry on a node: the collector over the replay fake (this machine has no GPU), the
real pynvml backend's "no NVML" path and error classification, functions a GPU does not support,
a GPU that falls off the bus, and the sampling loop (including an NVML call that hangs)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog

from launchpad.telemetry import pynvml_backend
from launchpad.telemetry.backend import GpuLost, NoNvml, NvmlFailure, TelemetryError, Unsupported
from launchpad.telemetry.collector import ABSENT, Collector
from launchpad.telemetry.encoding import DeltaDecoder
from launchpad.telemetry.replay import ReplayBackend
from launchpad.telemetry.sampler import REPLAY_ENV, Sampler, open_backend
from torchpass_common import log
from torchpass_common.config import HealthConfig
from torchpass_common.errors import TorchPassError

HEALTH = Path(__file__).resolve().parents[2] / "torchpassd" / "drill_jobs" / "health"


def _has_nvml() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def replay(name: str) -> ReplayBackend:
    return ReplayBackend.from_file(HEALTH / name, start=1000.0)


def collect(backend: ReplayBackend, samples: int) -> list[dict[str, Any]]:
    c = Collector(backend, node="n1")
    assert c.open()
    return [c.sample() for _ in range(samples)]


@pytest.mark.skipif(_has_nvml(), reason="this machine has NVML; the no-NVML path is for GPU-less nodes")
def test_without_nvml_the_real_collector_says_so_once_and_reads_nothing() -> None:
    log.setup()
    with structlog.testing.capture_logs() as logs:
        c = Collector(pynvml_backend.PynvmlBackend(), node="n1")
        assert c.open() is False
        sample = c.sample()
        c.sample()
        c.close()
    assert sample["nvml"] == ABSENT and sample["gpus"] == {} and "NVML" in sample["why"]
    assert [e["event"] for e in logs] == ["health.no_nvml"]


def test_pynvml_errors_are_classified() -> None:
    def err(code: int) -> Exception:
        return pynvml_backend.classify(pynvml.NVMLError(code), "probe", 3)

    assert isinstance(err(pynvml.NVML_ERROR_NOT_SUPPORTED), Unsupported)
    assert isinstance(err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), Unsupported)
    lost = err(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert isinstance(lost, GpuLost) and "GPU is lost" in str(lost) and "gpu=3" in str(lost)
    assert isinstance(err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), NoNvml)
    assert isinstance(err(pynvml.NVML_ERROR_NO_PERMISSION), NvmlFailure)
    assert pynvml_backend.throttle_names(pynvml.nvmlClocksThrottleReasonHwSlowdown
                                         | pynvml.nvmlClocksThrottleReasonSwThermalSlowdown) == \
        "HwSlowdown,SwThermalSlowdown"


def test_replayed_counters_carry_forward_and_xids_accumulate() -> None:
    samples = collect(replay("degrading.json"), 16)
    gpu0 = [s["gpus"]["0"] for s in samples]
    assert [s["t"] for s in samples[:3]] == [1000.0, 1005.0, 1010.0]
    assert gpu0[0]["ecc_agg_corr"] == 12 and gpu0[0]["nvlink_links"] == 18
    assert [g["ecc_vol_corr"] for g in gpu0[5:13]] == [0, 8, 20, 41, 77, 130, 210, 340]
    assert "xid_79" not in gpu0[11] and gpu0[12]["xid_79"] == 1 and gpu0[12]["xid_last"] == 79
    assert gpu0[12]["unsupported"] == "retired_pages"  # an H100 has row remapping instead
    assert gpu0[14]["answering"] is False and "GPU is lost" in gpu0[14]["error"]
    assert gpu0[14]["xid_79"] == 1  # the XID history survives the GPU's loss
    assert samples[15]["gpus"]["1"]["answering"] and samples[15]["gpus"]["1"]["temp_c"] == 58


def test_functions_a_gpu_does_not_support_are_listed_not_fatal() -> None:
    consumer = {"interval_s": 1, "gpus": [{"index": 0, "uuid": "GPU-x", "name": "GeForce RTX 4090"}],
                "steps": [{"gpus": {"0": {"ecc_volatile": "unsupported", "xid": "unsupported",
                                          "power": "error: Insufficient Permissions",
                                          "temperature": {"temp_c": 55}, "throttle": {"throttle": "GpuIdle"}}}}]}
    sample = collect(ReplayBackend(consumer, start=0.0), 2)[-1]
    g = sample["gpus"]["0"]
    assert g["answering"] is True and g["temp_c"] == 55 and g["throttle"] == "GpuIdle"
    assert g["unsupported"].split(",") == ["xid", "ecc_volatile", "ecc_aggregate", "retired_pages", "row_remap", "nvlink"]
    assert "Insufficient Permissions" in g["errors"]


def test_a_replayed_machine_without_nvml_is_reported_absent() -> None:
    c = Collector(ReplayBackend({"nvml": "absent", "steps": [{}]}), node="n1")
    assert c.open() is False and c.sample()["nvml"] == ABSENT


class _BrokenDriver(ReplayBackend):
    def open(self) -> list[Any]:
        raise NvmlFailure("nvmlInit: Unknown Error")


def test_an_nvml_that_will_not_start_is_reported_failed_not_absent() -> None:
    c = Collector(_BrokenDriver({"steps": [{}]}), node="n1")
    assert c.open() is False
    sample = c.sample()
    assert (sample["nvml"], sample["why"], sample["gpus"]) == ("failed", "nvmlInit: Unknown Error", {})


def test_a_bad_recording_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty.json").write_text(json.dumps({"steps": []}))
    with pytest.raises(TorchPassError, match="no steps"):
        ReplayBackend.from_file(tmp_path / "empty.json")
    with pytest.raises(TorchPassError, match="cannot read the GPU recording"):
        ReplayBackend.from_file(tmp_path / "missing.json")


def test_the_replay_env_selects_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPLAY_ENV, str(HEALTH / "stable.json"))
    assert open_backend("n1").name == "replay"
    monkeypatch.setenv(REPLAY_ENV, f"n3={HEALTH / 'degrading.json'},n4={HEALTH / 'stable.json'}")
    assert open_backend("n3").name == "replay" and open_backend("n1").name == "nvml"
    monkeypatch.delenv(REPLAY_ENV)
    assert open_backend("n1").name == "nvml"


async def _until(check: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


def test_heartbeats_carry_the_latest_sample_and_the_node_state_decodes_exactly() -> None:
    async def main() -> None:
        decoder, decoded = DeltaDecoder(), []
        async with Sampler(HealthConfig(sample_interval=0.01), "n1", backend=replay("degrading.json")) as sampler:
            while not decoded or decoded[-1]["gpus"]["0"]["answering"]:
                part = sampler.heartbeat_part()  # a heartbeat sees only the newest sample
                if part:
                    decoded.append(decoder.apply(part["gpu"]))
                    assert decoded[-1] == sampler.latest
                    assert sampler.heartbeat_part() == {}  # nothing new since
                await asyncio.sleep(0.004)
        corr = [s["gpus"]["0"]["ecc_vol_corr"] for s in decoded[:-1]]
        assert corr == sorted(corr) and decoded[-1]["gpus"]["0"]["xid_79"] == 1
    asyncio.run(main())


def test_the_sampler_does_nothing_more_without_nvml() -> None:
    async def main() -> None:
        async with Sampler(HealthConfig(sample_interval=0.01), "n1",
                           backend=ReplayBackend({"nvml": "absent", "steps": [{}]})) as sampler:
            await _until(lambda: sampler.samples == 1)
            assert sampler.heartbeat_part()["gpu"]["n"] == ABSENT
            await asyncio.sleep(0.1)
            assert sampler.samples == 1 and sampler.heartbeat_part() == {}
    asyncio.run(main())


def test_a_replay_sent_at_run_time_takes_over_from_a_node_without_nvml() -> None:
    """The gpu-degrade drill's fault (torchpassd's health_replay): a node that said "no NVML"
    samples the recording from then on, starting with a keyframe of its GPUs; a malformed
    recording is refused and the node keeps what it had."""
    async def main() -> None:
        decoder = DeltaDecoder()
        async with Sampler(HealthConfig(sample_interval=0.01), "n3",
                           backend=ReplayBackend({"nvml": "absent", "steps": [{}]})) as sampler:
            await _until(lambda: sampler.samples == 1)
            assert decoder.apply(sampler.heartbeat_part()["gpu"])["nvml"] == ABSENT
            with pytest.raises(TelemetryError, match="has no steps"):
                await sampler.replay({"steps": []}, "broken.json")
            await sampler.replay(json.loads((HEALTH / "degrading.json").read_text()), "degrading.json")
            decoder, seen = DeltaDecoder(), []  # a receiver joining now: the first part is a keyframe
            while not seen or seen[-1]["gpus"]["0"]["answering"]:
                part = sampler.heartbeat_part()
                if part:
                    seen.append(decoder.apply(part["gpu"]))
                await asyncio.sleep(0.004)
            assert seen[-1]["gpus"]["0"]["xid_79"] == 1  # the recording played to its lost GPU
    asyncio.run(main())


class _HangingReplay(ReplayBackend):
    """The replay fake, but the second sample's temperature read blocks until released."""

    def __init__(self) -> None:
        super().__init__(json.loads((HEALTH / "stable.json").read_text()), start=0.0)
        self.release = threading.Event()

    def read(self, index: int, probe: str) -> dict[str, Any]:
        if self.step == 1 and probe == "temperature":
            assert self.release.wait(10), "test never released the hung read"
        return super().read(index, probe)


def test_a_hung_nvml_call_reports_the_gpus_not_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    from launchpad.telemetry import sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "MIN_HANG_S", 0.2)

    async def main() -> None:
        backend = _HangingReplay()
        async with Sampler(HealthConfig(sample_interval=0.01), "n1", backend=backend) as sampler:
            await _until(lambda: sampler.samples >= 2)
            hung = sampler.latest["gpus"]
            assert [g["answering"] for g in hung.values()] == [False, False]
            assert "did not answer within" in hung["0"]["error"]
            backend.release.set()
            await _until(lambda: sampler.samples >= 3)
            assert sampler.latest["gpus"]["0"]["answering"] is True
    asyncio.run(main())


def test_the_gpu_check_script_records_a_replayable_sequence(tmp_path: Path) -> None:
    """contrib/gpu-check on this GPU-less machine: fed by the replay fake, its recording replays
    to the same samples (on a lent GPU machine it records the real NVML the same way)."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "contrib" / "gpu-check" / "gpu_check.py"
    out = tmp_path / "check.json"
    env = {**os.environ, REPLAY_ENV: str(HEALTH / "degrading.json")}
    proc = subprocess.run([sys.executable, str(script), "--samples", "16", "--interval", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "replay matches: True" in proc.stdout
    rec = json.loads(out.read_text())["recording"]
    assert rec["interval_s"] == 0
    again = [s["gpus"] for s in collect(ReplayBackend(rec), 16)]
    assert again == [s["gpus"] for s in collect(replay("degrading.json"), 16)]
