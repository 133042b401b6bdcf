"""contrib/systemd/torchpassd.service as systemd itself reads it: `systemd-analyze verify`
without a single warning, an offline security review that rates it OK, and the settings the
daemon relies on (notify + watchdog, restart always without a start limit, the directories of its config)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass_common import config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "contrib" / "systemd" / "torchpassd.service"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this checkout's torchpassd (verify checks that the
    binary exists; the shipped path is /usr/local/bin/torchpassd)."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: run contrib/install/install-deps.sh"
    daemon = Path(sys.executable).parent / "torchpassd"
    assert daemon.exists(), f"{daemon} is missing: run `make setup`"
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/torchpassd " in text
    path = tmp_path / "torchpassd.service"
    path.write_text(text.replace("ExecStart=/usr/local/bin/torchpassd ", f"ExecStart={daemon} "))
    return path


def directives(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, value = line.split("=", 1)
            found[key.strip()] = value.strip()
    return found


def test_systemd_verifies_the_unit_without_warnings(unit_copy: Path) -> None:
    result = subprocess.run(["systemd-analyze", "verify", str(unit_copy)], capture_output=True, text=True,
                            timeout=60)
    # verify exits 0 on unknown keys and bad values (it only warns), so any output is a failure.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_offline_security_review_rates_the_unit_ok(unit_copy: Path) -> None:
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit_copy)],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for torchpassd.service: ([\d.]+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    print(f"systemd-analyze security exposure: {match[1]} {match[2]}")
    assert float(match[1]) <= 3.0, result.stdout  # a root daemon with network access: "OK" range


def test_unit_matches_what_torchpassd_expects() -> None:
    d = directives(UNIT.read_text())
    assert d["Type"] == "notify" and d["NotifyAccess"] == "main"  # sdnotify.ready() from the main process
    assert d["Restart"] == "always" and d["StartLimitIntervalSec"] == "0"  # outlives any outage
    assert d["WatchdogSec"].rstrip("s").isdigit()
    defaults = config.OrchestratorConfig()
    assert f"/run/{d['RuntimeDirectory']}" == str(Path(defaults.control_socket).parent)
    assert f"/var/lib/{d['StateDirectory']}" == defaults.state_dir
    assert d["ExecStart"].endswith(f"--config {config.DEFAULT_PATH}")
    assert "CAP_CHOWN" in d["CapabilityBoundingSet"]  # the control socket is handed to control_group
