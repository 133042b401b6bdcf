"""``python -m torchpass._bootstrap`` runs a script or a module as __main__ with argv intact, the
way python (and torchrun) would; without launchpad, torchpass only counts steps and register()
does nothing, so the script behaves as under plain torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchpass_common import agent_channel as ac

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


def bootstrap(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m torchpass._bootstrap ARGS`` without launchpad (no TORCHPASS_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "torchpass._bootstrap", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def run_bootstrap(args: list[str], cwd: Path) -> dict:
    out = bootstrap(args, cwd)
    assert out.returncode == 0, out.stderr
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


LEAVES_THINGS_OPEN = """
import atexit, sys
log = open(sys.argv[1], "w")  # never closed, block-buffered: only the interpreter's exit would flush it
log.write("trained\\n" * 1000)
atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran\\n"))
print("done")
"""


def test_a_finished_script_leaves_without_the_interpreter_teardown_and_loses_nothing(tmp_path: Path) -> None:
    """The bootstrap ends a worker whose script returned with os._exit(0) (torch's gloo objects can
    abort the process in the interpreter's teardown), after what that teardown would have done for
    the script: its unclosed files flushed, its atexit handlers run, its output flushed."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_THINGS_OPEN)
    res = bootstrap([str(script), str(tmp_path / "log"), str(tmp_path / "atexit")], cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == "done\n", res.stderr
    assert (tmp_path / "log").read_text() == "trained\n" * 1000
    assert (tmp_path / "atexit").read_text() == "atexit ran\n"


def test_a_script_ending_with_sys_exit_keeps_its_exit_code(tmp_path: Path) -> None:
    """sys.exit(0) finishes like a return (without the teardown); any other code is the worker's code."""
    for code in (0, 3):
        script = tmp_path / f"exits{code}.py"
        script.write_text(f"import sys\nprint('bye')\nsys.exit({code})\n")
        res = bootstrap([str(script)], cwd=tmp_path)
        assert (res.returncode, res.stdout) == (code, "bye\n"), res.stderr


def test_a_standby_takes_the_environment_it_is_given_whole_then_runs_the_script(tmp_path):
    """``--standby`` (launchpad/standby.py): torch is imported before the script is known; the
    environment written on stdin replaces the one it was started with; stdin is then empty, as a
    worker's; end of file before any environment: it leaves without running the script."""
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'argv': sys.argv, 'who': os.environ.get('WHO'), "
                      "'stale': os.environ.get('STALE'), 'stdin': sys.stdin.read()}))\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    given = {**base, "PYTHONPATH": str(ROOT), "WHO": "rank 3"}
    argv = [sys.executable, "-m", "torchpass._bootstrap", "--standby", str(script), "--lr", "1"]
    out = subprocess.run(argv, cwd=tmp_path, env={**base, "PYTHONPATH": str(ROOT), "STALE": "1"},
                         input=json.dumps(given) + "\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ready, _, rest = out.stdout.partition("\n")  # warm: said once torch was imported, before the script
    assert ready + "\n" == ac.STANDBY_READY.decode()
    assert json.loads(rest) == {"argv": [str(script), "--lr", "1"], "who": "rank 3", "stale": None, "stdin": ""}
    unused = subprocess.run(argv, cwd=tmp_path, env={**base, "PYTHONPATH": str(ROOT)}, input="",
                            capture_output=True, text=True, timeout=120)
    assert (unused.returncode, unused.stdout) == (0, ac.STANDBY_READY.decode())
