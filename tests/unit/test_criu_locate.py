"""Choosing a criu: the first candidate that is 4.2 or newer and passes `criu check` wins, and every
rejected one says why (3.17 and 4.1 are refused for this kernel's known failures). Candidates other
than the installed one are small scripts that answer like those criu releases do. Also the action
script's timeline, run the way criu runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from criu_hooks import actions, locate
from criu_hooks.errors import CriuUnavailable


def _fake_criu(path: Path, version: str, check_out: str = "Looks good.", check_rc: int = 0) -> str:
    path.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Version: {version}" ;;
  check) echo "{check_out}"; exit {check_rc} ;;
esac
""")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Make ``path`` the only candidate besides an empty project root and an empty PATH."""
    def use(path: str | None) -> None:
        if path:
            monkeypatch.setenv("TORCHPASS_CRIU", path)
        else:
            monkeypatch.delenv("TORCHPASS_CRIU", raising=False)
        monkeypatch.setenv("TORCHPASS_CRIU_ROOT", str(tmp_path / "no-root"))
        monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
        locate.find.cache_clear()
    yield use
    locate.find.cache_clear()


def test_version_parsing() -> None:
    assert locate.parse_version("Version: 4.2.1\nGitID: v4.2.1\n") == (4, 2, 1)
    assert locate.parse_version("Version: 3.17\n") == (3, 17)
    assert locate.parse_version("criu: command not found") is None


def test_old_releases_are_refused_with_the_reason(tmp_path: Path) -> None:
    c317 = locate.probe("system", _fake_criu(tmp_path / "c317", "3.17.1"))
    c411 = locate.probe("system", _fake_criu(tmp_path / "c411", "4.1.1"))
    for cand in (c317, c411):
        assert not cand.ok and "4.2 or newer" in cand.reason and "inet socket" in cand.reason


def test_failing_check_is_refused_with_criu_words(tmp_path: Path) -> None:
    cand = locate.probe("env", _fake_criu(tmp_path / "c", "4.2.1", "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds", 1))
    assert not cand.ok
    assert "criu check" in cand.reason and "vDSO" in cand.reason and os.uname().release in cand.reason


def test_missing_candidate(tmp_path: Path) -> None:
    cand = locate.probe("project", str(tmp_path / "absent"))
    assert (cand.ok, cand.reason) == (False, "not installed")


def test_first_working_candidate_is_chosen(only, tmp_path: Path) -> None:
    only(_fake_criu(tmp_path / "good", "4.2.1"))
    chosen = locate.find()
    assert chosen.source == "env" and chosen.version == (4, 2, 1)


def test_no_usable_criu_lists_every_candidate_and_how_to_fix(only, tmp_path: Path) -> None:
    only(_fake_criu(tmp_path / "old", "4.1.1"))
    with pytest.raises(CriuUnavailable) as err:
        locate.find()
    text = str(err.value)
    assert "env" in text and "too old" in text
    assert "project" in text and "not installed" in text
    assert "install-criu.sh" in text


def test_action_script_records_the_frozen_time(tmp_path: Path) -> None:
    script = actions.install(tmp_path)
    timeline = tmp_path / "dump.timeline"
    for action in ("pre-dump", "network-lock", "post-dump"):
        env = {**actions.env_for(timeline), "CRTOOLS_SCRIPT_ACTION": action}
        subprocess.run([str(script)], env=env, check=True, timeout=10)
    stamps = actions.read_timeline(timeline)
    assert list(stamps) == ["pre-dump", "network-lock", "post-dump"]
    assert 0 <= actions.span(stamps, "pre-dump", "post-dump") < 5
    assert actions.span(stamps, "pre-restore", "post-restore") is None
