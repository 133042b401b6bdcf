"""The CUDA side of a transparent capture: the driver's checkpoint API (cuCheckpointProcessLock,
Checkpoint, Restore, Unlock; driver 570+) moves a process's GPU state into its host memory, so that
criu can dump it, and back. Also the early refusal, before anything is paused, where that cannot
work: no driver, a driver older than 570 (580 to restore onto another GPU), MIG. The driver itself
refuses UVM (managed) and IPC memory at lock or checkpoint time; that answer is reported as such.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field
from pathlib import Path

from criu_hooks.errors import CudaCheckpointFailed, CudaCheckpointUnsupported
from torchpass_common import log

MIN_DRIVER = 570  # first driver with the cuCheckpointProcess* driver API
MIN_DRIVER_CROSS_GPU = 580  # restore onto a GPU other than the one checkpointed (gpuPairs)
CUDA_ERROR_NOT_SUPPORTED = 801


class ProcessState(enum.IntEnum):
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


@dataclass(frozen=True)
class NodeGpus:
    """What the node's NVIDIA stack offers; ``missing`` says why there is none."""

    driver: str | None = None  # e.g. "570.86.15"
    missing: str | None = None
    mig_gpus: list[str] = field(default_factory=list)  # GPUs (index: name) with MIG enabled

    @property
    def driver_major(self) -> int | None:
        try:
            return int(self.driver.split(".")[0]) if self.driver else None
        except ValueError:
            return None


def refusal(gpus: NodeGpus, *, cross_gpu: bool = False) -> str | None:
    """Why a CUDA process on a node like ``gpus`` cannot be checkpointed (None: it can)."""
    if gpus.missing:
        return f"no NVIDIA driver on this node ({gpus.missing})"
    major = gpus.driver_major
    if major is None or major < MIN_DRIVER:
        return f"NVIDIA driver {gpus.driver} has no CUDA checkpoint API; {MIN_DRIVER} or newer is needed"
    if cross_gpu and major < MIN_DRIVER_CROSS_GPU:
        return (f"NVIDIA driver {gpus.driver} cannot restore onto another GPU; "
                f"{MIN_DRIVER_CROSS_GPU} or newer is needed")
    if gpus.mig_gpus:
        return f"MIG is enabled on {', '.join(gpus.mig_gpus)}; CUDA checkpoint does not support MIG"
    return None


def uses_cuda(pid: int) -> bool:
    """Whether process ``pid`` has the CUDA driver library mapped (a CPU-only worker has not)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "/libcuda.so" in maps


def probe_node() -> NodeGpus:
    """Driver version and MIG state from NVML; never raises."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return NodeGpus(missing=f"NVML: {e}")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        mig = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError:  # GPUs without MIG support answer NOT_SUPPORTED
                continue
            if current == pynvml.NVML_DEVICE_MIG_ENABLE:
                mig.append(f"GPU {index} ({pynvml.nvmlDeviceGetName(handle)})")
        return NodeGpus(driver=str(driver), mig_gpus=mig)
    except pynvml.NVMLError as e:
        return NodeGpus(missing=f"NVML: {e}")
    finally:
        pynvml.nvmlShutdown()


def check(pid: int, *, cross_gpu: bool = False, where: dict[str, object] | None = None) -> Driver | None:
    """Before pausing: None if ``pid`` does not use CUDA (nothing to do), the driver API if it can
    be checkpointed, else CudaCheckpointUnsupported saying why (fall back to model-aware or wait)."""
    if not uses_cuda(pid):
        return None
    why = refusal(probe_node(), cross_gpu=cross_gpu)
    if why:
        raise CudaCheckpointUnsupported(f"cannot checkpoint the GPU state of process {pid}: {why}",
                                        hint="use model-aware migration (torchpass.register) for this job",
                                        **(where or {}))
    return Driver.open()


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _ReservedArgs(ctypes.Structure):  # CUcheckpointCheckpointArgs, ...UnlockArgs, ...RestoreArgs (no remap)
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class Driver:
    """cuCheckpointProcess* through ctypes on libcuda.so.1. All calls take the target's PID."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    @classmethod
    def open(cls) -> Driver:
        """Load libcuda and initialise it; CudaCheckpointUnsupported when it is absent or too old."""
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaCheckpointUnsupported(f"no NVIDIA driver on this node (libcuda.so.1: {e})",
                                            hint="use model-aware migration for GPU jobs here") from e
        if not hasattr(lib, "cuCheckpointProcessLock"):
            raise CudaCheckpointUnsupported(
                f"this libcuda has no cuCheckpointProcessLock: driver older than {MIN_DRIVER}",
                hint=f"install NVIDIA driver {MIN_DRIVER} or newer")
        drv = cls(lib)
        drv._call("cuInit", 0, pid=None)
        return drv

    def state(self, pid: int) -> ProcessState:
        out = ctypes.c_int()
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(out), pid=pid)
        return ProcessState(out.value)

    def lock(self, pid: int, timeout_s: float) -> None:
        """Block the process's further CUDA calls; waits for submitted work up to ``timeout_s``."""
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(_LockArgs(int(timeout_s * 1000))), pid=pid)

    def checkpoint(self, pid: int) -> None:
        """Copy the locked process's GPU memory into its host memory and release the GPU."""
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(_ReservedArgs()), pid=pid)

    def restore(self, pid: int) -> None:
        """Put a checkpointed process's GPU state back (on the same GPU model and index)."""
        self._call("cuCheckpointProcessRestore", pid, ctypes.byref(_ReservedArgs()), pid=pid)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.byref(_ReservedArgs()), pid=pid)

    def _call(self, name: str, *args: object, pid: int | None) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc == 0:
            return
        err = ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(err))
        what = f"{name} failed with {(err.value or b'?').decode()} ({rc})"
        log.get(pid=pid).warning("cuda.checkpoint_failed", call=name, code=rc)
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            raise CudaCheckpointUnsupported(
                f"{what}: the driver cannot checkpoint this process (UVM/managed or IPC memory?)",
                hint="use model-aware migration for this job", pid=pid)
        raise CudaCheckpointFailed(what, hint="the process was left as it was; see the driver log",
                                   pid=pid)
