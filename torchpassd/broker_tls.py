"""TLS material for the broker's listener when a site has no PKI of its own: a private CA and a
server certificate signed by it for the broker's addresses, made with the openssl command (EC
P-256 keys, quick to make). Clients trust the CA through broker.tls_ca. It does not configure
mosquitto (broker_auth.py writes its files) and never touches a CA that already exists."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from torchpass_common.errors import ConfigError

DAYS = 825  # the longest validity TLS clients accept for a server certificate


@dataclass(frozen=True)
class BrokerTLS:
    """Paths of the CA certificate (give it to clients) and the server's certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def as_tuple(self) -> tuple[str, str, str]:
        return str(self.ca), str(self.cert), str(self.key)


def make_broker_tls(directory: str | os.PathLike[str], names: list[str], *, ca_name: str = "torchpass-broker-ca",
                    days: int = DAYS) -> BrokerTLS:
    """In ``directory``: ca.crt/ca.key (made once, kept after), and server.crt/server.key for
    ``names`` (IP addresses or DNS names the clients connect to). Keys are 0600, certificates
    0644 (the broker may drop root before reading them)."""
    if not names:
        raise ConfigError("the broker's certificate needs at least one address or name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca, ca_key = d / "ca.crt", d / "ca.key"
    if not ca.exists():
        _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-days", str(days), "-subj", f"/CN={ca_name}", "-keyout", str(ca_key), "-out", str(ca))
    out = BrokerTLS(ca, d / "server.crt", d / "server.key")
    csr, ext = d / "server.csr", d / "server.ext"
    ext.write_text(f"subjectAltName={','.join(_san(n) for n in names)}\n"
                   "extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-subj", f"/CN={names[0]}", "-keyout", str(out.key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", str(days), "-extfile", str(ext), "-out", str(out.cert))
    csr.unlink()
    for path, mode in ((ca_key, 0o600), (out.key, 0o600), (ca, 0o644), (out.cert, 0o644)):
        path.chmod(mode)
    return out


def _san(name: str) -> str:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return f"DNS:{name}"
    return f"IP:{name}"


def _openssl(*args: str) -> None:
    try:
        subprocess.run(["openssl", *args], check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("the openssl command is missing", hint="apt install openssl") from None
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"openssl {args[0]} failed: {exc.stderr.strip()[-300:]}") from None
