"""``python -m torchpass._bootstrap`` runs a script or a module as __main__ with argv intact, the
way python (and torchrun) would; without launchpad, torchpass only counts steps and register()
does nothing, so the script behaves as under plain torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import torch
import torch.distributed as dist
import torchpass

p = torch.zeros(1, requires_grad=True)
p.grad = torch.ones(1)
opt = torch.optim.SGD([p], lr=0.1)
opt.step(); opt.step()
after_opt = torchpass.current_step()
torchpass.step()
opt.step()  # no longer counted once the script marks steps itself
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "after_opt": after_opt,
                  "final": torchpass.current_step(),
                  "register": torchpass.register(save=dict, load=lambda s: None),
                  "backend_patched": "TORCHPASS" in dist.Backend._plugins}))
"""


def run_bootstrap(args: list[str], cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "torchpass._bootstrap", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_script_runs_as_main_with_its_argv_and_torchpass_is_inert_without_launchpad(tmp_path):
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    got = run_bootstrap([str(script), "--lr", "0.1", "-m", "x"], cwd=tmp_path)
    assert got["argv"] == [str(script), "--lr", "0.1", "-m", "x"]
    assert got["name"] == "__main__"
    assert got["path0"] == str(script.parent)  # imports next to the script work, as with python
    assert (got["after_opt"], got["final"]) == (2, 3)
    assert got["register"] is None
    assert got["backend_patched"] is False  # no launchpad: the user's process group is untouched


def test_module_runs_as_main_like_python_dash_m(tmp_path):
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")
    (tmp_path / "trainpkg" / "main.py").write_text(PROBE)
    got = run_bootstrap(["-m", "trainpkg.main", "--epochs", "3"], cwd=tmp_path)
    assert got["argv"] == [str(tmp_path / "trainpkg" / "main.py"), "--epochs", "3"]
    assert got["name"] == "__main__"
