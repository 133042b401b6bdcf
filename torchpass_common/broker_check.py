"""Whether the broker is fit to carry a job's control plane: encrypted (TLS, broker.tls_ca) and
closed to anonymous clients (probed by connecting without credentials). torchpassd and launchpad
refuse a broker that is neither, unless the site's config says broker.allow_insecure = true, in
which case every start logs a warning. It does not hold a connection (mqtt.py does)."""

from __future__ import annotations

import uuid

import aiomqtt

from torchpass_common import log
from torchpass_common.config import BrokerConfig
from torchpass_common.errors import ConfigError
from torchpass_common.mqtt import broker_credentials

PROBE_TIMEOUT = 5.0


async def admits_anonymous(cfg: BrokerConfig) -> bool | None:
    """True if the broker lets a client in without credentials, False if it refuses it, None if
    it could not be asked (not reachable now: the caller's own connection retries)."""
    _, _, tls = broker_credentials(cfg)
    probe = aiomqtt.Client(cfg.host, cfg.port, identifier=f"torchpass-probe-{uuid.uuid4().hex[:12]}",
                           tls_context=tls, timeout=PROBE_TIMEOUT)
    try:
        async with probe:
            return True
    except aiomqtt.MqttCodeError as exc:
        code = getattr(exc.rc, "value", exc.rc)
        return False if code in (4, 5, 134, 135) else None  # bad user or password / not authorised
    except aiomqtt.MqttError:
        return None


async def require_secure(cfg: BrokerConfig, who: str) -> None:
    """Refuse (ConfigError) a broker without TLS or open to anonymous clients, unless
    ``cfg.allow_insecure``; then log a warning naming what is insecure."""
    problems = [] if cfg.tls_ca else ["its connection is not encrypted (no broker.tls_ca)"]
    if await admits_anonymous(cfg):
        problems.append("it admits anonymous clients")
    if not problems:
        return
    where = f"{cfg.host}:{cfg.port}"
    if cfg.allow_insecure:
        log.get().warning("broker.insecure", who=who, broker=where, problems=problems,
                          effect="anyone who reaches the broker can read and forge TorchPass commands",
                          hint="set up TLS and accounts (python -m torchpassd.broker_auth) and remove "
                               "broker.allow_insecure")
        return
    raise ConfigError(f"{who} refuses the broker at {where}: {'; '.join(problems)}",
                      hint="set the broker up with accounts and TLS (python -m torchpassd.broker_auth DIR "
                           "--tls-for HOST) and set broker.tls_ca; broker.allow_insecure = true runs without "
                           "(never on a shared cluster)")
