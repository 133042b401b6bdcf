"""DeviceMesh (1-D and 2-D), FSDP2, HSDP, tensor parallel, new_group, new_subgroups, functional
and object collectives, barrier and monitored_barrier in one script (tests/unit/
test_mesh_subgroups_reform.py's WORKLOAD) under launchpad and under the venv's real torchrun, four
workers on gloo: every printed result (collective values, losses as float.hex, parameter hashes)
is the same, and under launchpad every group is a TorchPass group."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.group_workers import results

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
WORLD = 4


def _mesh_module():
    spec = importlib.util.spec_from_file_location("mesh_reform", ROOT / "tests/unit/test_mesh_subgroups_reform.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str], tmp: Path) -> dict[int, dict]:
    out = tmp / Path(argv[0]).name
    out.mkdir()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "TORCHPASS_LOG_DIR": str(tmp), "MESH_RESULT_DIR": str(out)})
    found = results(out)
    teardown_abort = res.returncode != 0 and len(found) == WORLD and "SIGABRT" in res.stderr  # torch 2.13 gloo flake
    assert res.returncode == 0 or teardown_abort, f"{argv[:4]} rc {res.returncode}: {res.stderr[-4000:]}"
    assert sorted(found) == list(range(WORLD)), res.stdout[-2000:]
    return found


MESH = _mesh_module()


@pytest.mark.slow
def test_mesh_apis_match_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "mesh_workload.py"
    script.write_text(MESH.WORKLOAD)
    args = ["--standalone", f"--nproc-per-node={WORLD}", str(script)]
    under_torchrun = _run([TORCHRUN, *args], tmp_path)
    under_launchpad = _run([PYTHON, "-m", "launchpad", *args], tmp_path)
    for rank in range(WORLD):
        got, want = under_launchpad[rank], under_torchrun[rank]
        assert got["out"] == want["out"], f"rank {rank}: results differ from torchrun's"
        assert len(got["out"]) > 100 and any(".train.hsdp.losses" in k for k in got["out"])
        assert set(got["kinds"].values()) == {"TorchPassGroup"}, got["kinds"]
        assert set(want["kinds"].values()) == {"ProcessGroup"}
