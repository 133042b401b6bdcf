"""torchpass_common.log's routing: without a file every event at the level goes to the console as
before (torchpassd and the others); with a file (launchpad) the console shows its level and above,
the file everything from info (or a lower console level) as JSON; TORCHPASS_LOG_LEVEL sets the
console level; a level that is not one is a ConfigError."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchpass_common import log
from torchpass_common.errors import ConfigError


class Console(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture(autouse=True)
def _restore_defaults() -> Iterator[None]:
    yield
    log.setup()  # autouse, so torn down after monkeypatch restored the environment


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("TORCHPASS_LOG_LEVEL", "TORCHPASS_LOG_JSON"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def emit_all() -> None:
    logger = log.get(job="j1")
    logger.debug("t.debug")
    logger.info("t.info")
    logger.warning("t.warning")
    logger.error("t.error")


def events(text: str) -> list[str]:
    return [json.loads(line)["event"] for line in text.splitlines()]


def test_without_a_file_the_console_gets_everything_at_the_level(env: pytest.MonkeyPatch) -> None:
    console = Console()
    log.setup(stream=console)
    emit_all()
    assert events(console.getvalue()) == ["t.info", "t.warning", "t.error"]


def test_with_a_file_the_console_shows_warnings_and_the_file_all(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    console, path = Console(), tmp_path / "lp.log"
    log.setup("warning", stream=console, file=path)
    emit_all()
    assert events(console.getvalue()) == ["t.warning", "t.error"]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["t.info", "t.warning", "t.error"]
    assert all(r["job"] == "j1" and "timestamp" in r for r in records)


def test_environment_level_overrides_the_console_only(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("TORCHPASS_LOG_LEVEL", "error")
    console, path = Console(), tmp_path / "lp.log"
    log.setup("warning", stream=console, file=path)
    emit_all()
    assert events(console.getvalue()) == ["t.error"]
    assert events(path.read_text()) == ["t.info", "t.warning", "t.error"]


def test_a_lower_console_level_lowers_the_file_too(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("TORCHPASS_LOG_LEVEL", "debug")
    console, path = Console(), tmp_path / "lp.log"
    log.setup("warning", stream=console, file=path)
    emit_all()
    assert events(console.getvalue()) == events(path.read_text()) == ["t.debug", "t.info", "t.warning", "t.error"]


def test_console_may_be_key_value_while_the_file_stays_json(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("TORCHPASS_LOG_JSON", "0")
    console, path = Console(), tmp_path / "lp.log"
    log.setup("warning", stream=console, file=path)
    emit_all()
    assert "t.warning" in console.getvalue() and not console.getvalue().lstrip().startswith("{")
    assert events(path.read_text()) == ["t.info", "t.warning", "t.error"]


def test_setup_again_appends_to_the_file_and_closes_the_old_one(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "lp.log"
    log.setup("warning", stream=Console(), file=path)
    log.get().info("t.first")
    log.setup("warning", stream=Console(), file=path)
    log.get().info("t.second")
    log.setup(stream=Console())
    log.get().info("t.console_only")
    assert events(path.read_text()) == ["t.first", "t.second"]


def test_unknown_level_is_a_config_error(env: pytest.MonkeyPatch) -> None:
    env.setenv("TORCHPASS_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="TORCHPASS_LOG_LEVEL"):
        log.setup(stream=Console())
