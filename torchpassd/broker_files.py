"""The files of an authenticated TorchPass broker: mosquitto.conf (listener, no anonymous access,
the dynamic security plugin, TLS), the plugin's initial JSON (torchpassd's admin client and role,
default deny) and torchpassd's password file. Standard library only, so that tools that run
before any venv (the dev cluster) write the same broker as an operator's install. Talking to
the running plugin (job accounts) is broker_auth.py's."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass_common.errors import ConfigError

DYNSEC_PLUGIN = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")
CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
ADMIN_ROLE = "torchpassd"
PBKDF2_ITERATIONS = 101  # what mosquitto_ctrl writes; the plugin reads the count from the file
TOPIC_TREE = "torchpass/#"  # every TorchPass topic (protocol.TOPIC_ROOT lies under it)
# the most a client may send in one packet: four times the largest TorchPass message (64 KiB,
# torchpass_common.protocol.MAX_MESSAGE_BYTES, which every reader refuses beyond)
MAX_PACKET_BYTES = 256 * 1024
OWNED = ("publishClientSend", "publishClientReceive", "subscribePattern", "unsubscribePattern")



def acls(topic_filter: str) -> list[dict[str, Any]]:
    """ACL entries letting a role publish, receive and subscribe under ``topic_filter``."""
    return [{"acltype": t, "topic": topic_filter, "allow": True} for t in OWNED]


def hashed(password: str, salt: bytes | None = None) -> dict[str, Any]:
    """``password``, salt and iterations as the plugin stores them (PBKDF2-SHA512, base64)."""
    salt = salt or os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS, 64)
    return {"password": base64.b64encode(digest).decode(), "salt": base64.b64encode(salt).decode(),
            "iterations": PBKDF2_ITERATIONS}


def dynsec_document(admin_user: str, admin_password: str) -> dict[str, Any]:
    """The plugin's initial state: torchpassd's admin client (administers the plugin, reads and
    writes every TorchPass topic), nothing for anyone else (default deny for publish/subscribe)."""
    role = {"rolename": ADMIN_ROLE, "acls": [*acls(f"{CONTROL_TOPIC.rsplit('/', 1)[0]}/#"),
                                             *acls(TOPIC_TREE)]}
    client = {"username": admin_user, "textName": "torchpassd (admin)", **hashed(admin_password),
              "roles": [{"rolename": ADMIN_ROLE}]}
    return {"clients": [client], "roles": [role], "groups": [],
            "defaultACLAccess": {"publishClientSend": False, "publishClientReceive": True,
                                 "subscribe": False, "unsubscribe": True}}


@dataclass(frozen=True)
class BrokerFiles:
    conf: Path
    dynsec: Path
    password_file: Path


def write_broker_files(directory: str | os.PathLike[str], *, port: int, host: str = "",
                       admin_user: str = "torchpassd", tls: tuple[str, str, str] | None = None,
                       refuse_plain_port: int | None = None, broker_user: str = "mosquitto",
                       plugin: Path = DYNSEC_PLUGIN) -> BrokerFiles:
    """Write mosquitto.conf (authenticated listener, the dynamic security plugin, TLS when ``tls``
    = (ca, cert, key) is given), dynamic-security.json and torchpassd's password file (0600) into
    ``directory``. The admin password is fresh; the files are the broker's state from then on.
    ``refuse_plain_port``: also listen there without TLS and refuse every client ("not authorised"),
    so a client set up without TLS hears a clear refusal rather than a broken handshake.
    mosquitto runs as ``broker_user`` and rewrites the plugin's file: run as root, this gives it
    the directory and that file."""
    if not plugin.exists():
        raise ConfigError(f"mosquitto's dynamic security plugin {plugin} is missing",
                          hint="install mosquitto 2.0 or newer (Debian: apt install mosquitto)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(24)
    files = BrokerFiles(d / "mosquitto.conf", d / "dynamic-security.json", d / "broker.password")
    for path, text in ((files.password_file, password + "\n"),
                       (files.dynsec, json.dumps(dynsec_document(admin_user, password), indent=1))):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    if os.geteuid() == 0 and broker_user != "root":
        try:
            pw = pwd.getpwnam(broker_user)
        except KeyError:
            raise ConfigError(f"the broker's user {broker_user} does not exist",
                              hint="install mosquitto or pass the user mosquitto runs as") from None
        for path in (d, files.dynsec):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    # per listener: the accounts (plugin) belong to the authenticated listener alone
    lines = ["per_listener_settings true", f"user {broker_user}",
             f"max_packet_size {MAX_PACKET_BYTES}",  # a client sending more is disconnected
             f"listener {port} {host}".rstrip(),
             "allow_anonymous false", f"plugin {plugin}", f"plugin_opt_config_file {files.dynsec}"]
    if tls:
        ca, cert, key = tls
        lines += [f"cafile {ca}", f"certfile {cert}", f"keyfile {key}", "tls_version tlsv1.2"]
    if refuse_plain_port is not None:
        if not tls:
            raise ConfigError("a refusing plain listener is for a TLS broker", hint="give tls too")
        lines += [f"listener {refuse_plain_port} {host}".rstrip(), "allow_anonymous false"]
    files.conf.write_text("# written by torchpassd.broker_auth: authenticated TorchPass broker\n"
                          + "\n".join(lines) + "\n")
    return files
