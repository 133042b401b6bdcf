"""The shipped example config: it loads, it states the real defaults, and it documents every
key, so an operator copying it sees everything that can be set."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from torchpass_common import config

EXAMPLE = Path(__file__).resolve().parents[2] / "contrib" / "config" / "torchpass.toml.example"


def test_example_loads_and_states_the_built_in_defaults() -> None:
    cfg = config.load(EXAMPLE)
    assert cfg.timeouts.validate()
    assert dataclasses.replace(cfg, source=None) == config.Config()


def test_example_documents_every_key() -> None:
    raw = tomllib.loads(EXAMPLE.read_text())
    for section in dataclasses.fields(config.Config):
        if section.name == "source":
            continue
        keys = {f.name for f in dataclasses.fields(section.default_factory)}  # type: ignore[arg-type]
        missing = keys - set(raw.get(section.name, {}))
        assert not missing, f"add [{section.name}] {sorted(missing)} to {EXAMPLE.name} with a comment"
