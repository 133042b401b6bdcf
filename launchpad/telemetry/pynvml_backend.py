"""The real NVML backend on nvidia-ml-py (``import pynvml``): every call goes through
:func:`_call`, which turns pynvml's errors into the telemetry classes (a function the GPU lacks
is Unsupported, a GPU that fell off the bus is GpuLost). Only machines with an NVIDIA driver run
it for real; elsewhere :meth:`PynvmlBackend.open` raises NoNvml."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from launchpad.telemetry.backend import GpuIdentity, GpuLost, NoNvml, NvmlFailure, Scalar, Unsupported

_MAX_EVENTS_PER_DRAIN = 256


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NoNvml("the nvidia-ml-py package (pynvml) is not installed",
                     hint="pip install nvidia-ml-py; telemetry stays off until then") from exc
    return pynvml


def classify(exc: Exception, what: str, index: int | None = None) -> Exception:
    """The telemetry error for a pynvml error raised while reading ``what``."""
    nv = _nvml()
    code = getattr(exc, "value", None)
    text = f"{what}: {exc}"
    if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
        return Unsupported(text, gpu=index)
    if code in (nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_RESET_REQUIRED, nv.NVML_ERROR_GPU_NOT_FOUND):
        return GpuLost(text, gpu=index, hint="the GPU needs a reset or service; move work off this node")
    if code in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED):
        return NoNvml(f"no NVML: {exc}", hint="no NVIDIA driver on this node; GPU telemetry stays off")
    return NvmlFailure(text, gpu=index)


def _call(what: str, index: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    nv = _nvml()
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        raise classify(exc, what, index) from exc


def throttle_names(mask: int) -> str:
    """The active clock-event (throttle) reasons of ``mask`` as a sorted, comma-joined string."""
    nv = _nvml()
    prefix = "nvmlClocksThrottleReason"
    names = [n[len(prefix):] for n in dir(nv)
             if n.startswith(prefix) and n[len(prefix):] not in ("All", "None", "UserDefinedClocks")
             and getattr(nv, n) & mask]
    return ",".join(sorted(names))


class PynvmlBackend:
    """NVML through pynvml for the GPUs of this node."""

    name = "nvml"

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._events: Any = None
        self._no_xid: set[int] = set()
        self._initialised = False

    def open(self) -> list[GpuIdentity]:
        nv = _nvml()
        _call("nvmlInit", None, nv.nvmlInit)
        self._initialised = True
        gpus = []
        for i in range(_call("nvmlDeviceGetCount", None, nv.nvmlDeviceGetCount)):
            h = _call("nvmlDeviceGetHandleByIndex", i, nv.nvmlDeviceGetHandleByIndex, i)
            self._handles.append(h)
            gpus.append(GpuIdentity(i, str(_call("uuid", i, nv.nvmlDeviceGetUUID, h)),
                                    str(_call("name", i, nv.nvmlDeviceGetName, h))))
        self._register_xids()
        return gpus

    def _register_xids(self) -> None:
        nv = _nvml()
        try:
            self._events = _call("nvmlEventSetCreate", None, nv.nvmlEventSetCreate)
        except (Unsupported, NvmlFailure):
            self._no_xid = set(range(len(self._handles)))
            return
        for i, h in enumerate(self._handles):
            try:
                _call("nvmlDeviceRegisterEvents", i, nv.nvmlDeviceRegisterEvents, h,
                      nv.nvmlEventTypeXidCriticalError, self._events)
            except (Unsupported, NvmlFailure, GpuLost):
                self._no_xid.add(i)

    def unsupported_xid(self) -> set[int]:
        return set(self._no_xid)

    def read(self, index: int, probe: str) -> dict[str, Scalar]:
        return getattr(self, f"_probe_{probe}")(index, self._handles[index])

    def _probe_ecc_volatile(self, i: int, h: Any) -> dict[str, Scalar]:
        return self._ecc(i, h, "vol", _nvml().NVML_VOLATILE_ECC)

    def _probe_ecc_aggregate(self, i: int, h: Any) -> dict[str, Scalar]:
        return self._ecc(i, h, "agg", _nvml().NVML_AGGREGATE_ECC)

    def _ecc(self, i: int, h: Any, tag: str, counter: int) -> dict[str, Scalar]:
        nv = _nvml()
        get = nv.nvmlDeviceGetTotalEccErrors
        return {f"ecc_{tag}_corr": int(_call(f"ECC {tag} corrected", i, get, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, counter)),
                f"ecc_{tag}_unc": int(_call(f"ECC {tag} uncorrected", i, get, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter))}

    def _probe_retired_pages(self, i: int, h: Any) -> dict[str, Scalar]:
        nv = _nvml()
        pages = nv.nvmlDeviceGetRetiredPages
        return {"retired_sbe": len(_call("retired pages (SBE)", i, pages, h,
                                         nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)),
                "retired_dbe": len(_call("retired pages (DBE)", i, pages, h,
                                         nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
                "retired_pending": bool(_call("retired pages pending", i,
                                              nv.nvmlDeviceGetRetiredPagesPendingStatus, h))}

    def _probe_row_remap(self, i: int, h: Any) -> dict[str, Scalar]:
        corr, unc, pending, failed = _call("row remapping", i, _nvml().nvmlDeviceGetRemappedRows, h)
        return {"remap_corr": int(corr), "remap_unc": int(unc), "remap_pending": bool(pending),
                "remap_failed": bool(failed)}

    def _probe_nvlink(self, i: int, h: Any) -> dict[str, Scalar]:
        """Error counters summed over the active links; Unsupported when the GPU has no NVLink."""
        nv = _nvml()
        counters = {"nvlink_replay": nv.NVML_NVLINK_ERROR_DL_REPLAY, "nvlink_recovery": nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                    "nvlink_crc_flit": nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, "nvlink_crc_data": nv.NVML_NVLINK_ERROR_DL_CRC_DATA}
        sums = dict.fromkeys(counters, 0)
        active = 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                up = _call(f"NVLink {link} state", i, nv.nvmlDeviceGetNvLinkState, h, link)
            except (Unsupported, NvmlFailure):
                if link == 0:
                    raise
                break  # past the last link this GPU has
            if not up:
                continue
            active += 1
            for field, counter in counters.items():
                try:
                    sums[field] += int(_call(f"NVLink {link} errors", i, nv.nvmlDeviceGetNvLinkErrorCounter,
                                             h, link, counter))
                except Unsupported:
                    continue
        return {"nvlink_links": active, **sums}

    def _probe_temperature(self, i: int, h: Any) -> dict[str, Scalar]:
        nv = _nvml()
        return {"temp_c": int(_call("temperature", i, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))}

    def _probe_power(self, i: int, h: Any) -> dict[str, Scalar]:
        return {"power_w": round(_call("power", i, _nvml().nvmlDeviceGetPowerUsage, h) / 1000.0, 1)}

    def _probe_throttle(self, i: int, h: Any) -> dict[str, Scalar]:
        nv = _nvml()
        try:
            mask = _call("clock event reasons", i, nv.nvmlDeviceGetCurrentClocksEventReasons, h)
        except Unsupported:  # drivers before the rename only have the old name
            mask = _call("clock throttle reasons", i, nv.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        return {"throttle": throttle_names(int(mask))}

    def xid_events(self) -> list[tuple[int, int]]:
        if self._events is None:
            return []
        nv = _nvml()
        found = []
        for _ in range(_MAX_EVENTS_PER_DRAIN):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if exc.value == nv.NVML_ERROR_TIMEOUT:
                    break  # no more events pending
                raise classify(exc, "XID event wait") from exc
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                index = int(_call("event device index", None, nv.nvmlDeviceGetIndex, data.device))
                found.append((index, int(data.eventData)))
        return found

    def tick(self) -> float:
        return time.time()

    def close(self) -> None:
        nv = _nvml()
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except nv.NVMLError:
                pass  # freeing during shutdown; nothing to report
            self._events = None
        if self._initialised:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass
            self._initialised, self._handles = False, []
