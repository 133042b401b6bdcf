"""The CUDA checkpoint refusal: a GPU worker that cannot be checkpointed is refused before anything
is paused, with the reason. This machine has no GPU: the driver facts for the refusals a GPU node
would give (old driver, MIG) are written out by hand; the no-driver path is this machine's own."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from criu_hooks import cuda
from criu_hooks.errors import CudaCheckpointUnsupported
from torchpass_common.errors import MigrationError


def test_refusals_name_the_cause() -> None:
    assert "no NVIDIA driver" in cuda.refusal(cuda.NodeGpus(missing="NVML: library not found"))
    assert "570 or newer" in cuda.refusal(cuda.NodeGpus(driver="550.127.05"))
    assert "MIG is enabled on GPU 0 (NVIDIA H100)" in cuda.refusal(
        cuda.NodeGpus(driver="575.51.03", mig_gpus=["GPU 0 (NVIDIA H100)"]))
    assert "580 or newer" in cuda.refusal(cuda.NodeGpus(driver="575.51.03"), cross_gpu=True)


def test_supported_driver_is_not_refused() -> None:
    assert cuda.refusal(cuda.NodeGpus(driver="575.51.03")) is None
    assert cuda.refusal(cuda.NodeGpus(driver="580.65.06"), cross_gpu=True) is None


def test_this_node_without_driver_is_refused_clearly() -> None:
    gpus = cuda.probe_node()
    if gpus.missing is None:
        pytest.skip(f"this machine has an NVIDIA driver ({gpus.driver}); the refusal path needs none")
    assert "no NVIDIA driver" in cuda.refusal(gpus)
    with pytest.raises(CudaCheckpointUnsupported, match="no NVIDIA driver") as err:
        cuda.Driver.open()
    assert isinstance(err.value, MigrationError)  # callers roll the migration back


def test_cpu_only_worker_needs_no_cuda_checkpoint() -> None:
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert cuda.check(worker.pid, where={"rank": 1}) is None
    finally:
        worker.kill()
        worker.wait(timeout=10)


def test_worker_mapping_libcuda_on_a_node_without_driver_is_refused_before_pausing(tmp_path) -> None:
    # Stand-in for a CUDA worker on a node whose driver went missing: a process mapping a file named
    # libcuda.so.1 (there is no real libcuda here). The refusal must come before any lock or dump.
    if cuda.probe_node().missing is None:
        pytest.skip("this machine has an NVIDIA driver")
    fake = tmp_path / "libcuda.so.1"
    fake.write_bytes(b"\0" * 4096)
    code = f"import mmap, time; f = open({str(fake)!r}, 'rb'); m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ); time.sleep(30)"
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not cuda.uses_cuda(worker.pid) and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.01)
        with pytest.raises(CudaCheckpointUnsupported, match=rf"process {worker.pid}: no NVIDIA driver.*rank=1"):
            cuda.check(worker.pid, where={"rank": 1})
    finally:
        worker.kill()
        worker.wait(timeout=10)
