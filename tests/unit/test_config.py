"""The config loader: defaults, overrides by file and environment, and the errors a user sees."""

from __future__ import annotations

import pytest

from torchpass_common import config
from torchpass_common.errors import ConfigError
from torchpass_common.timeouts import Timeouts


def test_defaults_when_default_file_absent(monkeypatch, tmp_path):
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.toml")
    cfg = config.load()
    assert cfg.source is None
    assert cfg.slurm.spare_reservation == "torchpass_spares"
    assert cfg.broker.port == 1883


def test_file_from_environment_overrides(monkeypatch, tmp_path):
    f = tmp_path / "tp.toml"
    f.write_text('[broker]\nport = 18830\n[slurm]\npoll_interval = 2\n[timeouts]\ncollective = 5\n')
    monkeypatch.setenv(config.ENV_VAR, str(f))
    cfg = config.load()
    assert cfg.broker.port == 18830
    assert cfg.slurm.poll_interval == 2.0 and isinstance(cfg.slurm.poll_interval, float)
    assert cfg.timeouts.collective == 5.0
    assert cfg.source == str(f)


def test_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "text, match",
    [
        ("[broker\nport=1", "not valid TOML"),
        ("[brokr]\nport = 1", "unknown section.*brokr"),
        ("[broker]\nprot = 1", r"unknown key.*prot.*known keys"),
        ("[broker]\nport = 'x'", r"broker.port must be of type int"),
        ("[slurm]\nbackend = 'magic'", "slurm.backend must be"),
        ("[wormhole]\nstreams = 0", "wormhole.streams"),
        ("[timeouts]\ncollective = 90", r"timeouts.collective \(90.0 s\) must be shorter than timeouts.step"),
        ("[orchestrator]\ndrills_enabled = 1", "must be of type bool"),
        ("[faults]\ncriu = 'both'", "faults.criu must be"),
    ],
)
def test_bad_config_names_file_and_key(text, match, tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        config.load(f)
    assert str(f) in str(err.value)


def test_timeout_hierarchy_must_nest():
    Timeouts().validate()
    with pytest.raises(ConfigError, match="reform"):
        Timeouts(reform=500, decision=300).validate()
    with pytest.raises(ConfigError, match="heartbeat"):
        Timeouts(heartbeat_interval=100, heartbeat_missed=5).validate()
