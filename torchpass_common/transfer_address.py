"""Where a migration's state travels: one typed address for every wormhole sender and receiver.

A ``TransferAddress`` is a host, a port and the migration's token. For a sender (a donor's save, a
recover donation, a transparent move) ``host`` is the receiver's address; for a listener (a
joiner's source, a survivor's load_from) it is the address to bind. On the wire (MQTT commands and
the agent channel, both msgpack; a joiner's environment, JSON) it is the map
``{"host": str, "port": int, "token": hex}``, made by :meth:`wire` and read back only by
:meth:`parse`, which refuses anything else with a ProtocolError naming what and why. This module
does not open sockets (launchpad.wormhole does) and does not pick ports (torchpassd does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchpass_common.errors import ProtocolError

# State never comes from or goes to a filesystem path named by a command: nothing read from disk
# on a command's word is loaded.
NO_PATHS = "commands never carry filesystem paths: state moves only through the wormhole"
KEYS = ("host", "port", "token")


@dataclass(frozen=True)
class TransferAddress:
    """A wormhole end: ``host``:``port``, authenticated with the migration's ``token``."""

    host: str
    port: int
    token: bytes

    def __repr__(self) -> str:  # the token is a secret: never in a log line
        return f"TransferAddress({self.host}:{self.port})"

    def wire(self) -> dict[str, Any]:
        """The map a command or the join environment carries (msgpack and JSON both take it)."""
        return {"host": self.host, "port": self.port, "token": self.token.hex()}

    @classmethod
    def parse(cls, raw: Any, what: str) -> TransferAddress:
        """``raw`` (a :meth:`wire` map) as an address, or ProtocolError("``what`` is refused: why")."""
        if fault := _fault(raw):
            raise ProtocolError(f"{what} is refused: {fault}",
                                hint="give a wormhole end {host, port, token}; launchpad, torchpass and "
                                     "torchpassd must be the same TorchPass version")
        return cls(raw["host"], raw["port"], bytes.fromhex(raw["token"]))


def _fault(raw: Any) -> str | None:
    """Why ``raw`` is not a wire address, or None."""
    if isinstance(raw, dict) and "path" in raw:
        return f"it carries a filesystem path ({raw['path']!r}): {NO_PATHS}"
    if not isinstance(raw, dict) or not set(KEYS) <= raw.keys():
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        return f"it must be a wormhole end {{{', '.join(KEYS)}}}, got {got}"
    host, port, token = (raw[k] for k in KEYS)
    if not isinstance(host, str) or not host:
        return f"its host must be a name or an address, got {host!r}"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"its port must be 1-65535, got {port!r}"
    try:
        if not isinstance(token, str) or not bytes.fromhex(token):
            raise ValueError
    except ValueError:
        return "its token must be non-empty hex"
    return None
