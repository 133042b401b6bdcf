"""The dev cluster's broker, set up as a site's: no anonymous access, torchpassd's admin account
and per-job accounts (mosquitto's dynamic security plugin), TLS with a CA made for the cluster.
Its files are written by torchpassd's own broker_files and broker_tls (standard library only, so
this tool still runs before any venv); the [broker] and credentials settings every TorchPass
process of the cluster gets come from here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchpass_common.errors import ConfigError
from torchpassd.broker_files import write_broker_files
from torchpassd.broker_tls import make_broker_tls

from .errors import DevClusterError
from .instance import Instance

ADMIN = "torchpassd"
LOG_LINES = "persistence false\nlog_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"


def directory(inst: Instance) -> Path:
    return inst.sub("broker")


def conf(inst: Instance) -> Path:
    return directory(inst) / "mosquitto.conf"


def write(inst: Instance) -> None:
    """The broker's CA and certificate (for the bridge address and the name ``ctl``), its config,
    the plugin's state and torchpassd's password file (0600, root's)."""
    try:
        tls = make_broker_tls(directory(inst) / "tls", [inst.bridge_addr, "ctl"],
                              ca_name=f"tpdevcluster-{inst.id}-ca")
        files = write_broker_files(directory(inst), port=inst.port("mosquitto"), host=inst.bridge_addr,
                                   admin_user=ADMIN, tls=tls.as_tuple(), broker_user="root",
                                   refuse_plain_port=inst.port("mosquitto_plain"))
    except ConfigError as exc:
        raise DevClusterError(f"cannot set up the broker: {exc.message}", instance=inst.id, hint=exc.hint) from exc
    files.conf.write_text(files.conf.read_text() + LOG_LINES)


def settings(inst: Instance) -> dict[str, Any]:
    """The [broker] section of the cluster's torchpass.toml: torchpassd's account and the CA.
    Launchpads read the same file but take their job's own account from torchpassd."""
    d = directory(inst)
    return {"host": inst.bridge_addr, "port": inst.port("mosquitto"), "tls_ca": str(d / "tls" / "ca.crt"),
            "username": ADMIN, "password_file": str(d / "broker.password")}


def credentials(inst: Instance) -> dict[str, Any]:
    """The [orchestrator] keys of the credentials endpoint (torchpassd hands each job's launchpads
    their account there, for a munge proof)."""
    return {"credentials_endpoint": f"{inst.bridge_addr}:{inst.port('credentials')}",
            "munge_socket": str(inst.munge_socket)}
