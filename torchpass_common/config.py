"""Loading and validating the one TorchPass config file (TOML). Default path
/etc/torchpass/torchpass.toml, overridden by ``--config`` or ``TORCHPASS_CONFIG``. Each section
is a dataclass; unknown keys, wrong types and bad values are ConfigErrors naming file and key."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass_common.errors import ConfigError
from torchpass_common.timeouts import Timeouts

DEFAULT_PATH = Path("/etc/torchpass/torchpass.toml")
ENV_VAR = "TORCHPASS_CONFIG"


@dataclass(frozen=True)
class BrokerConfig:
    """Where the MQTT broker is and how to authenticate to it."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str = ""
    password_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    keepalive: int = 5
    allow_insecure: bool = False  # accept plain MQTT and a broker open to anonymous clients (warned at every start)


@dataclass(frozen=True)
class SlurmConfig:
    """How the scheduler adapter reaches slurmctld and where spares live."""

    backend: str = "auto"  # auto | pyslurm | rest | commands
    slurm_conf: str = ""
    poll_interval: float = 1.0
    spare_reservation: str = "torchpass_spares"
    rest_url: str = ""  # http://HOST:PORT (JWT) or unix:/PATH (slurmrestd local auth)
    rest_user: str = ""  # user the JWT is minted for; default: the user torchpassd runs as
    command_timeout: float = 30.0

    def validate(self) -> None:
        if self.backend not in ("auto", "pyslurm", "rest", "commands"):
            raise ConfigError(f"slurm.backend must be auto, pyslurm, rest or commands, got {self.backend!r}")
        if self.poll_interval <= 0:
            raise ConfigError(f"slurm.poll_interval must be positive, got {self.poll_interval}")


@dataclass(frozen=True)
class OrchestratorConfig:
    """torchpassd's own files and endpoints."""

    state_dir: str = "/var/lib/torchpass"
    control_socket: str = "/run/torchpass/torchpassd.sock"
    control_group: str = ""
    metrics_port: int = 9464
    drills_enabled: bool = False
    credentials_endpoint: str = ""  # HOST:PORT where torchpassd hands launchpads their job's broker account
    munge_socket: str = ""
    unplanned_no_spare: str = "wait"  # a node died and no spare is free: wait (survivors parked) | fail
    spares_per_incident: int = 2  # spares one drained node's migration may use up before it is given up

    def validate(self) -> None:
        if self.unplanned_no_spare not in ("wait", "fail"):
            raise ConfigError(f"orchestrator.unplanned_no_spare must be wait or fail, got {self.unplanned_no_spare!r}")
        if self.spares_per_incident < 1:
            raise ConfigError(f"orchestrator.spares_per_incident must be at least 1, got {self.spares_per_incident}")


@dataclass(frozen=True)
class WormholeConfig:
    """The bulk state-transfer engine."""

    streams: int = 2
    chunk_bytes: int = 8 << 20
    bind_host: str = "0.0.0.0"

    def validate(self) -> None:
        if not 1 <= self.streams <= 64:
            raise ConfigError(f"wormhole.streams must be between 1 and 64, got {self.streams}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"wormhole.chunk_bytes must be at least 4096, got {self.chunk_bytes}")


HEALTH_ACTIONS = ("drain", "migrate", "none")


@dataclass(frozen=True)
class HealthConfig:
    """GPU health: how often launchpad samples NVML, which signals mean "this GPU is about to
    fail", and what torchpassd then does (drain the node in Slurm, migrate only, or just record)."""

    enabled: bool = True
    sample_interval: float = 5.0
    action: str = "drain"  # drain | migrate | none
    fatal_xids: list = field(default_factory=lambda: [48, 79, 94, 95])  # list of int (TOML array)
    uncorrected_ecc: int = 1
    corrected_ecc_burst: int = 1000
    nvlink_error_burst: int = 100
    rate_window: float = 600.0
    temperature_limit: float = 90.0
    temperature_for: float = 120.0
    pending_retirement: bool = True

    def validate(self) -> None:
        if self.action not in HEALTH_ACTIONS:
            raise ConfigError(f"health.action must be drain, migrate or none, got {self.action!r}")
        if self.sample_interval <= 0 or self.rate_window <= 0 or self.temperature_for < 0:
            raise ConfigError("health.sample_interval and health.rate_window must be positive and "
                              "health.temperature_for not negative")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in self.fatal_xids):
            raise ConfigError(f"health.fatal_xids must be a list of XID numbers, got {self.fatal_xids!r}")
        for key in ("uncorrected_ecc", "corrected_ecc_burst", "nvlink_error_burst"):
            if getattr(self, key) < 1:
                raise ConfigError(f"health.{key} must be at least 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class StragglerConfig:
    """Straggler migration (opt-in): a node whose ranks want ``ratio`` times the CPU a step that the
    other nodes of the job want (their median), for ``steps`` steps in a row, is migrated like a
    drain, at most once per job every ``cooldown`` seconds (torchpassd/straggler.py)."""

    enabled: bool = False
    ratio: float = 1.5
    steps: int = 50
    cooldown: float = 600.0

    def validate(self) -> None:
        if self.ratio <= 1.0:
            raise ConfigError(f"straggler.ratio must be above 1 (1.5: half as slow again), got {self.ratio}")
        if self.steps < 1 or self.cooldown < 0:
            raise ConfigError(f"straggler.steps must be at least 1 and straggler.cooldown not negative, "
                              f"got {self.steps} and {self.cooldown}")


@dataclass(frozen=True)
class LinksConfig:
    """The network paths of a job's collectives (torchpassd/link_policy.py). ``fabric``: the
    interface they take (launchpad sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to it for a job
    that sets neither); "" leaves the choice to the job and reroutes nothing. ``fallback``: the
    interface they are rerouted over, without moving any rank, while a node's ``fabric`` link is
    down; "" (or a fallback that is down too, for ``hold_down`` seconds) migrates that node's ranks
    instead. Back on the fabric
    once every node's fabric link has been up ``hold_down`` seconds; a link that changed
    ``flap_transitions`` times within ``flap_window`` seconds is flapping: the job stays on the
    fallback until the link has been quiet that long."""

    fabric: str = ""
    fallback: str = ""
    hold_down: float = 10.0
    flap_transitions: int = 3
    flap_window: float = 60.0

    def validate(self) -> None:
        if self.fallback and not self.fabric:
            raise ConfigError("links.fallback needs links.fabric (the path it stands in for)")
        if self.fallback and self.fallback == self.fabric:
            raise ConfigError(f"links.fallback must be another interface than links.fabric ({self.fabric})")
        if self.hold_down < 0 or self.flap_window <= 0 or self.flap_transitions < 2:
            raise ConfigError(f"links.hold_down must not be negative, links.flap_window positive and "
                              f"links.flap_transitions at least 2, got {self.hold_down}, {self.flap_window} "
                              f"and {self.flap_transitions}")


@dataclass(frozen=True)
class FaultsConfig:
    """Fault injection for drills and tests, set by the operator in the site config (never by a
    job): ``criu = "dump"`` makes every CRIU dump fail (criu refuses the worker's live TCP
    connection), ``"restore"`` every restore (the memory pages lost on the way). Empty in production."""

    criu: str = ""

    def validate(self) -> None:
        if self.criu not in ("", "dump", "restore"):
            raise ConfigError(f"faults.criu must be \"dump\", \"restore\" or empty, got {self.criu!r}")


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``source`` is the file it came from (None: built-in defaults)."""

    broker: BrokerConfig = field(default_factory=BrokerConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    wormhole: WormholeConfig = field(default_factory=WormholeConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    health: HealthConfig = field(default_factory=HealthConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    links: LinksConfig = field(default_factory=LinksConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    source: str | None = None


def _check_type(value: Any, annotation: Any, key: str, origin: str) -> Any:
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # noqa: S307 - dataclass field annotations only
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = typing.get_origin(annotation)
    if base in (typing.Union, types.UnionType):
        if any(_matches(value, a) for a in typing.get_args(annotation)):
            return value
    elif _matches(value, annotation):
        return value
    raise ConfigError(f"{origin}: {key} must be of type {getattr(annotation, '__name__', annotation)}, "
                      f"got {type(value).__name__} {value!r}")


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is bool:
        return isinstance(value, bool)
    if annotation in (int, float):
        return isinstance(value, annotation) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _build(cls: type, data: dict[str, Any], section: str, origin: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{origin}: unknown key(s) in [{section}]: {', '.join(unknown)}",
                          hint=f"known keys: {', '.join(sorted(known))}")
    kwargs = {k: _check_type(v, known[k].type, f"{section}.{k}", origin) for k, v in data.items()}
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc.message}", hint=exc.hint) from exc
    return obj


def parse(text: str, origin: str = "<string>") -> Config:
    """Parse and validate TOML text into a Config."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from exc
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "source"}
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"{origin}: unknown section(s): {', '.join(unknown)}",
                          hint=f"known sections: {', '.join(sorted(sections))}")
    built = {}
    for name, f in sections.items():
        data = raw.get(name, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: [{name}] must be a table")
        built[name] = _build(f.default_factory, data, name, origin)  # type: ignore[misc]
    return Config(**built, source=origin)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load the config: ``path`` if given, else $TORCHPASS_CONFIG, else the default path.
    A missing default file gives the built-in defaults; a missing explicit file is an error."""
    explicit = path or os.environ.get(ENV_VAR)
    p = Path(explicit) if explicit else DEFAULT_PATH
    if not p.exists():
        if explicit:
            raise ConfigError(f"config file {p} does not exist",
                              hint=f"pass an existing file with --config or {ENV_VAR}")
        return Config()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
    return parse(text, str(p))


Sections = dict[str, dict[str, Any]]


def render(sections: Sections) -> str:
    """TOML text of ``sections`` (section -> key -> string, number, boolean or list of those), as
    a torchpass.toml holds them; tools use it to write the configs they hand to torchpassd."""
    out = []
    for name, keys in sections.items():
        out.append(f"[{name}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
    return "\n".join(out) + "\n"


def derive(text: str, overrides: Sections) -> str:
    """The TOML ``text`` of a config with ``overrides`` applied (a value of None removes the key),
    e.g. a site's torchpass.toml given another state_dir for a second torchpassd."""
    sections: Sections = {name: dict(keys) for name, keys in tomllib.loads(text).items()}
    for name, keys in overrides.items():
        section = sections.setdefault(name, {})
        for key, value in keys.items():
            if value is None:
                section.pop(key, None)
            else:
                section[key] = value
    return render(sections)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | os.PathLike):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {type(value).__name__} {value!r} into a TOML config")
